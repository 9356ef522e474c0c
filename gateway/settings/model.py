"""Which model `pdserve serve` serves and under what name."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, Field, field_validator, model_validator

from llm_engine.model_files import check_model_name, is_local_path
from llm_engine.weight_schemes import QUANTIZATION_FLAG_NAMES, check_quantization_flag


class ModelSettings(BaseModel):

    model: str | None = Field(
        None,
        description="a Hugging Face model id (org/name, resolved through the Hugging Face cache: HF_HOME, "
                    "HF_HUB_OFFLINE, HF_TOKEN) or a local model directory; also the positional MODEL "
                    "(default: SmolLM2-135M-Instruct, prepared on first use)")
    revision: str | None = Field(
        None, description="branch, tag or commit of a Hugging Face model id (default: its default branch)")
    served_model_name: str | None = Field(
        None,
        description="model name clients send (default: the id as given, or the model directory's name)")
    quantization: str | None = Field(
        None,
        description="the checkpoint's quantization method, as vLLM's -q names it: compressed-tensors (int8 "
                    "W8A8 / W8A16, int4 W4A16; `pdserve quantize` writes one), checked against its "
                    "config.json "
                    "(default: what the checkpoint's quantization_config says, or unquantized)")

    @field_validator("model")
    @classmethod
    def _model_is_a_dir_or_an_id(cls, model: str | None) -> str | None:
        if model is not None:
            check_model_name(model)  # its form only: the id is resolved at start (gateway/startup.py)
        return model

    @field_validator("quantization")
    @classmethod
    def _quantization_is_served(cls, quantization: str | None) -> str | None:
        if quantization is not None and quantization not in QUANTIZATION_FLAG_NAMES:
            check_quantization_flag(quantization, None)  # raises, naming the flag and what is served
        return quantization

    @model_validator(mode="after")
    def _revision_of_an_id(self) -> Self:
        if self.revision is not None and (self.model is None or is_local_path(self.model)):
            raise ValueError("--revision applies to a Hugging Face model id given as --model, not to a "
                             "directory or the default model")
        return self
