"""The imperative shell: KV blocks, scheduling, the model runner, the engine loop and the LLM API."""

from .beam_search import BeamSearchOutput, BeamSearchSequence
from .block_manager import BlockManager
from .classify import ClassificationOutput, ClassificationRequestOutput
from .config import EngineConfig
from .engine import EngineStats, LLMEngine
from .executor import WorkerDiedError
from .llm import LLM
from .lora import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput
from .pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from .runner import ModelRunner, StepInput, StepResult
from .sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from .scheduler import Scheduler, SchedulerOutput
from .scoring import ScoringOutput, ScoringRequestOutput
from .sequence import Sequence

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "BlockManager", "EngineConfig", "EngineStats", "LLMEngine", "LLM", "CompletionOutput",
           "Logprob", "RequestOutput", "ModelRunner", "StepInput", "StepResult", "SamplingParams",
           "Scheduler", "SchedulerOutput", "Sequence", "StructuredOutputsParams", "WorkerDiedError",
           "EmbeddingOutput", "EmbeddingRequestOutput", "PoolingParams", "ClassificationOutput",
           "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput", "LoRARequest"]
