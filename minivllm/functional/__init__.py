"""Pure functions of (params, inputs) -> outputs: the whole Qwen3 forward, sampling, generate."""

from .activation import silu_and_mul
from .classify import activate, classifier_logits
from .attention import REFERENCE, AttentionBackend, ReferenceBackend, reference_attention, write_kv
from .embedding import embed, lm_head
from .generate import generate
from .layer import attention_block, decoder_layer, mlp_block
from .linear import column_linear, merged_column_linear, qkv_linear, row_linear, split_qkv
from .model import batch_for, forward, hidden_states
from .norm import add_rms_norm, rms_norm
from .pooling import last_token_rows, pool_last_token, pooled_embedding
from .rope import apply_rope, rope_attention_scale, rope_cos_sin, rope_inv_freq
from .sampling import SamplingBatch, SamplingRow, make_sampling_batch, sample

__all__ = [
    "silu_and_mul", "activate", "classifier_logits", "REFERENCE", "AttentionBackend", "ReferenceBackend", "reference_attention",
    "write_kv", "embed", "lm_head", "generate", "attention_block", "decoder_layer", "mlp_block",
    "column_linear", "merged_column_linear", "qkv_linear", "split_qkv", "row_linear", "batch_for",
    "forward", "hidden_states", "pooled_embedding", "last_token_rows", "pool_last_token",
    "add_rms_norm", "rms_norm", "apply_rope", "rope_attention_scale", "rope_cos_sin",
    "rope_inv_freq",
    "sample", "SamplingBatch", "SamplingRow", "make_sampling_batch",
]
