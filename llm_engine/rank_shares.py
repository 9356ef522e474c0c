"""What each rank of a tensor-parallel worker holds of every layer: llm_engine/tensor_parallel.py shards by
it, llm_engine/kv_cache.py sizes each rank's cache by it, the runner gathers and scatters KV by it."""

from __future__ import annotations

from dataclasses import dataclass

from llm_engine.config import ModelSpec


@dataclass(frozen=True)
class RankShare:
    """What one rank holds of every layer: KV heads [kv_start, kv_start + num_kv_heads), the query heads that
    attend to them, MLP columns [mlp_start, mlp_start + mlp_width)."""

    kv_start: int
    num_kv_heads: int
    q_start: int
    num_heads: int
    mlp_start: int
    mlp_width: int

    def q_rows(self, head_dim: int) -> slice:
        """This rank's rows of q_proj (its query heads), and its columns of o_proj."""
        return slice(self.q_start * head_dim, (self.q_start + self.num_heads) * head_dim)

    def kv_rows(self, head_dim: int) -> slice:
        """This rank's rows of k_proj and v_proj (its KV heads)."""
        return slice(self.kv_start * head_dim, (self.kv_start + self.num_kv_heads) * head_dim)

    @property
    def mlp_rows(self) -> slice:
        """This rank's rows of gate_proj and up_proj, and its columns of down_proj."""
        return slice(self.mlp_start, self.mlp_start + self.mlp_width)


def degrees(num_heads: int, num_kv_heads: int) -> list[int]:
    """The degrees that split a model's heads: up to one per KV head (unevenly where they do not divide),
    and past that the multiples of the KV heads that divide the query heads (each KV head then replicated
    on several ranks, each rank with its own query heads of that head's group, as vLLM does)."""
    if num_heads % num_kv_heads:
        return [1]
    return [*range(1, num_kv_heads + 1),
            *(size for size in range(2 * num_kv_heads, num_heads + 1, num_kv_heads) if num_heads % size == 0)]


def rank_shares(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> list[RankShare]:
    """Each rank's share, in rank order (`size` one of degrees()): KV heads and MLP columns as even as they
    go, the first ranks one more where they do not divide (9 heads / 3 KV heads over 2 ranks: 6 + 3 heads,
    2 + 1 KV heads); past one rank per KV head, consecutive ranks hold the same KV head (8 heads / 2 KV
    heads over 4 ranks: 2 query heads each, KV head 0 on ranks 0 and 1)."""
    group = num_heads // num_kv_heads  # query heads per KV head
    shares, kv_start, mlp_start = [], 0, 0
    for rank in range(size):
        mlp = intermediate_size // size + (rank < intermediate_size % size)
        if size > num_kv_heads:  # replicated KV heads
            replicas, per_rank = size // num_kv_heads, num_heads // size
            shares.append(RankShare(rank // replicas, 1, rank * per_rank, per_rank, mlp_start, mlp))
        else:
            kv = num_kv_heads // size + (rank < num_kv_heads % size)
            shares.append(RankShare(kv_start, kv, kv_start * group, kv * group, mlp_start, mlp))
            kv_start += kv
        mlp_start += mlp
    return shares


def vocab_rows(vocab_size: int, size: int, rank: int) -> slice:
    """Rank `rank`'s rows of the lm_head (its share of the vocabulary): as even as they go, the first ranks
    one more."""
    start = rank * (vocab_size // size) + min(rank, vocab_size % size)
    return slice(start, start + vocab_size // size + (rank < vocab_size % size))


def spec_shares(spec: ModelSpec, size: int) -> list[RankShare]:
    return rank_shares(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, size)


def check_tensor_parallel(spec: ModelSpec, size: int, flag: str = "--tensor-parallel-size") -> None:
    """Raise ValueError naming `flag` if `size` ranks cannot split this model's heads
    (degrees above)."""
    if size < 1:
        raise ValueError(f"{flag} must be >= 1, got {size}")
    if size not in (possible := degrees(spec.num_heads, spec.num_kv_heads)):
        raise ValueError(
            f"{flag} {size} does not split the model's {spec.num_heads} attention heads and "
            f"{spec.num_kv_heads} KV heads: up to one rank per KV head, past that a multiple of the KV heads "
            f"that divides the attention heads; degrees that do: {', '.join(map(str, possible))}")
