"""Architecture hyperparameters of a Llama-family model (presets live in configs/models/)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RopeScaling(BaseModel):
    """Llama 3.1 ("llama3") RoPE frequency scaling."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("high_freq_factor must be greater than low_freq_factor")
        return self


class ModelConfig(BaseModel):
    """Shape of the network. Field names are the model's own, not MaxText's flag names."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str
    num_layers: int = Field(gt=0)
    embed_dim: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    mlp_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    rope_theta: float = Field(gt=0)
    rope_scaling: RopeScaling | None = None
    norm_eps: float = Field(gt=0)
    tie_embeddings: bool = False
    max_position: int = Field(gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        return self

    @property
    def num_groups(self) -> int:
        """Query heads that share one kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        """Parameter count, counting a tied embedding once."""
        e, d = self.embed_dim, self.head_dim
        attn = e * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * e * self.mlp_dim
        per_layer = attn + mlp + 2 * e
        head = 0 if self.tie_embeddings else e * self.vocab_size
        return self.num_layers * per_layer + self.vocab_size * e + e + head
