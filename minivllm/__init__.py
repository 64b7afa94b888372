"""minivllm: a small, fast LLM inference engine for Qwen3, written as pure functions over
immutable pytrees.

    params = minivllm.load("path/to/Qwen3-0.6B")
    cache = minivllm.init_cache(params, num_blocks=64)
    new_tokens, cache = minivllm.generate(params, cache, [[1, 2, 3]], max_new_tokens=16)

The engine, shaped like vLLM's:

    llm = minivllm.LLM("path/to/Qwen3-0.6B")
    outputs = llm.generate(["Hello"], minivllm.SamplingParams(temperature=0.8, max_tokens=32))
"""

from .functional import forward, generate
from .runtime import (BeamSearchOutput, BeamSearchParams, BeamSearchSequence,
                      ClassificationOutput, ClassificationRequestOutput, CompletionOutput,
                      EmbeddingOutput, EmbeddingRequestOutput, LLM, LLMEngine, Logprob, LoRARequest,
                      PoolingParams, RequestOutput, SamplingParams, ScoringOutput,
                      ScoringRequestOutput, StructuredOutputsParams, WorkerDiedError)
from .state import (Batch, KVCache, LayerParams, ModelConfig, MoELayerParams, Params, SeqChunk,
                    ShardSpec, config_for_shape, init_cache, make_batch, random_params)
from .state.load import CheckpointError, load

__all__ = ["forward", "generate", "Batch", "KVCache", "LayerParams", "MoELayerParams", "ModelConfig",
           "Params", "SeqChunk", "ShardSpec", "config_for_shape", "init_cache", "make_batch", "random_params",
           "CheckpointError", "load", "LLM", "LLMEngine", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "WorkerDiedError", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "StructuredOutputsParams", "PoolingParams", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
           "ScoringOutput", "ScoringRequestOutput", "LoRARequest"]
__version__ = "0.1.0"
