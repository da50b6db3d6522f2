"""The engine's public data: what callers (the server, the bench) hand in and get back.

Plain dataclasses, no llama.cpp types: the server knows nothing of ctypes and the engine
knows nothing of HTTP. Everything a request can tune is here, parsed once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from localspec.engine.oracle import DepthOracle
from localspec.planning.types import AUX_ROOM

SpecMode = Literal["off", "draft", "ngram", "hybrid", "auto"]
StopType = Literal["eos", "word", "limit", "none"]


class Cancel(Protocol):
    """What stops a generation between steps: a threading.Event, or a caller's own rule."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class ModelSettings:
    """How one GGUF is loaded (target or draft)."""

    path: str
    n_gpu_layers: int = 0
    n_ctx: int = 4096  # per slot; the llama context holds n_ctx * n_seq_max cells
    n_batch: int = 1024
    n_ubatch: int = 1024
    # None = planning.types.default_flash_attn() for where the layers run and how many slots
    flash_attn: bool | None = None
    type_k: str = "f16"  # f16 | q8_0 | q4_0
    type_v: str = "f16"
    n_threads: int | None = None  # None = a sensible split of the physical cores
    n_threads_batch: int | None = None
    main_gpu: int = 0  # the GPU that holds the model (single-GPU) or its output layer
    # Share of the offloaded layers per GPU, in device order; None = llama.cpp's default
    # (proportional to free memory). (0, 1) pins a draft model to the second GPU.
    tensor_split: tuple[float, ...] | None = None
    # llama.cpp's extra weight buffers (repacking, AMX); None = llama.default_repack_weights()
    repack_weights: bool | None = None


@dataclass(frozen=True)
class SpecSettings:
    """Speculative decoding defaults; a request may override n_max/n_min/p_min."""

    mode: SpecMode = "auto"
    n_max: int = 16
    n_min: int = 0
    p_min: float = 0.75
    ngram_min: int = 2  # shortest suffix match the n-gram drafter accepts
    draft_window: int = 512  # the draft model sees only the last N prompt tokens
    # cost-model draft lengths (and switching a source off) in every mode, not only "auto";
    # False keeps "draft"/"ngram"/"hybrid" at fixed n_max/p_min like llama-server
    adaptive: bool = False
    # the draft model drafts ahead on its own thread while the target verifies (its cost is
    # then hidden); None = on when both contexts' threads fit the physical cores
    pipeline: bool | None = None
    pipeline_ahead: int = 16  # how far past the verified tokens the draft thread may run
    # draft tokens the target waits for when the draft thread is still producing them (0: a
    # plain step instead; for a draft about as fast as the target, waiting is what pays)
    pipeline_wait: int = 0
    # rejected drafts kept in each result (context tail, draft, the target's tokens) for the
    # server's local file (speculative.record_rejections)
    record_rejections: bool = False
    # "exact": a drafted token is accepted only where it is the target's own draw. "topk": also
    # where it is among the target's accept_top_k likeliest with at least accept_p_min
    # probability (faster, not bit-identical to the target; never with a grammar)
    accept: Literal["exact", "topk"] = "exact"
    accept_top_k: int = 3
    accept_p_min: float = 0.1
    # depth that follows the context: draft lengths from the acceptance of the request's own
    # language (GenerationRequest.language), not of every request together
    by_language: bool = False
    # no drafting while the target's recent entropy (nats, an average over its last steps) is
    # above this: the target is unsure, so the drafts would be rejected; 0: off
    entropy_max: float = 0.0
    # an n-gram draft stops where the earlier occurrences of its (longest) match disagree on
    # what came next: past that point half its tokens were rejected
    ngram_agree: bool = False
    # auto mode: the draft model drafts only while its measured per-token cost is below this
    # share of a target step (0: any cost the cost model accepts); a costly draft's time, its
    # catch-up included, is better left to the free n-gram drafts a few tokens later
    draft_cost_max: float = 0.0
    # auto mode: each step takes the n-gram draft or the draft model's, whichever the cost
    # model expects to yield more per ms (the model's catch-up on the tokens it is behind
    # priced in); False: the n-gram draft whenever it has one, the model only otherwise
    weigh_sources: bool = False
    # auto mode: the draft model drafts on past a token it is less than p_min sure of while
    # the target has recently accepted such tokens often enough to pay for them
    learn_p_min: bool = False


@dataclass(frozen=True)
class EngineSettings:
    target: ModelSettings
    draft: ModelSettings | None = None
    n_slots: int = 1
    spec: SpecSettings = field(default_factory=SpecSettings)
    cache_reuse: int = 256  # min chunk length moved by KV shift; 0 disables chunk reuse
    # min length of a moved run that ENDS the prompt (the FIM suffix block behind the cursor);
    # only used when cache_reuse > 0
    tail_reuse: int = 32
    # a moved tail block drifts from what a cold evaluation would compute as the tokens before
    # it change; once this many tokens changed since it was last computed, recompute it
    tail_max_drift: int = 8
    # re-evaluate this many tokens at the start of a moved tail block (nearest the edit): the
    # tokens right after an edit carry most of the change (bench/results/speculative/
    # engine-md-03-*.json: the cache-quality replay of each drift cap and refresh length)
    tail_refresh: int = 32
    # and, past those, re-evaluate a rolling window of this many tokens per keystroke: every
    # token is recomputed every few keys, so the drift cap rarely forces a whole-block recompute
    tail_roll: int = 32
    # keep the target's KV exact (as a cold evaluation computes it) instead of moving runs by a
    # KV shift whenever that costs at most this many ms more, at the measured prefill price; it
    # also repays an earlier shift, at a ring warm-up too. 0: always shift, as llama-server
    exact_ms: float = 100.0
    # prompt tokens per llama_decode while prefilling: a cancel (the editor aborted this
    # keystroke) is noticed between pieces, and what was evaluated stays cached for the next
    prefill_chunk: int = 128
    # with flash attention, a prompt the engine evaluates with nothing else to run goes in
    # pieces as long as this many ms (cache.Pieces): fewer, faster batches, while a request
    # that arrives meanwhile waits at most about this long for the piece in flight
    prefill_piece_ms: float = 500.0
    # each decode runs on at most the cores other processes leave free (engine/threads.py);
    # False: always the configured thread counts
    follow_load: bool = True
    # sequences for a request's extra completions (planning.types.aux_sequences; None: two
    # per slot) and the KV cells each holds beyond the shared prompt
    n_aux: int | None = None
    aux_room: int = AUX_ROOM
    # bytes llama.cpp may allocate on each offload device (limits.gpu_memory_gb): a load over
    # it fails as out of memory, as on a card that size (engine/memory.py); None: no cap
    gpu_memory_cap: int | None = None
    # host memory for slot contexts a new prompt would overwrite (engine/hostcache.py); None:
    # sized at load from the memory free then (planning/host_cache.py); 0: off, an engine
    # built in code (a test, a benchmark) unless it asks; `localspec up` sizes it
    host_cache_bytes: int | None = 0


# llama-server's default chain (common_params_sampling.samplers); at the default values every
# sampler but top_k, top_p, min_p and temperature is a no-op
DEFAULT_SAMPLERS = (
    "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
)  # fmt: skip
DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")


@dataclass(frozen=True)
class SamplingParams:
    """llama-server's sampling fields (common_params_sampling, same defaults); samplers apply
    in order, then a seeded draw. Hashable: a request's parameters are cached by value.

    ``repeat_last_n``/``dry_penalty_last_n`` are already resolved (-1 = the context size);
    ``logit_bias`` holds (token, bias) pairs, -inf bans, and carries the EOG bans of
    ``ignore_eos``; ``grammar`` is GBNF text (a JSON schema already converted), checked to parse.
    """

    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    temperature: float = 0.8
    seed: int = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: random
    top_n_sigma: float = -1.0
    typ_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = DRY_SEQUENCE_BREAKERS
    mirostat: int = 0  # 0 off, 1 Mirostat, 2 Mirostat 2.0 (replaces the chain)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    grammar: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalties_on(self) -> bool:
        """llama.cpp's penalties sampler does something (else it is an empty sampler)."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def dry_on(self) -> bool:
        return self.dry_multiplier != 0.0 and self.dry_base >= 1.0 and self.dry_penalty_last_n != 0

    @property
    def plain(self) -> bool:
        """Only top_k, top_p, min_p and temperature shape the draw (every other sampler named
        in the chain is a no-op at its value, no bias, no grammar): a greedy request may then
        take llama.cpp's argmax alone, which is what the whole chain would pick."""
        names = set(self.samplers)
        return not (
            self.logit_bias
            or self.grammar
            or self.mirostat
            or ("penalties" in names and self.penalties_on)
            or ("dry" in names and self.dry_on)
            or ("top_n_sigma" in names and self.top_n_sigma > 0.0)
            or ("typ_p" in names and self.typ_p < 1.0)
            or ("xtc" in names and self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5)
            or ("temperature" in names and self.dynatemp_range > 0.0)
        )


@dataclass(frozen=True)
class PromptLayout:
    """A prompt as the engine is to evaluate it: its tokens, the lengths of its leading blocks
    (each evaluated on its own: an editor's ring chunks, docs/engine.md "Ring blocks"; none:
    causal throughout), and whether every block after the first also sees the first."""

    tokens: list[int]
    blocks: tuple[int, ...] = ()
    block_sink: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    slot: int
    prompt: list[int]  # already assembled and truncated to fit the slot's context
    # lengths of the prompt's leading blocks, each evaluated on its own (an editor's ring
    # chunks: docs/engine.md, "Ring blocks"); () evaluates the prompt causally throughout
    blocks: tuple[int, ...] = ()
    block_sink: bool = False  # every block after the first also sees the first (a header)
    n_predict: int = -1  # -1: until a stop rule or the context ends; 0: fill the cache only
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    n_indent: int = 0
    t_max_predict_ms: int = 0
    cache_prompt: bool = True
    spec_n_max: int | None = None  # None: the engine's setting; 0 disables speculation
    spec_n_min: int | None = None
    spec_p_min: float | None = None
    n_probs: int = 0  # > 0: report each emitted token's top-n candidates (llama-server n_probs)
    # the code's language label (localspec.language); with SpecSettings.by_language each
    # language keeps its own acceptance record, which sets its draft lengths
    language: str | None = None
    # a benchmark's ceiling: drafts cut to what the target will accept (engine/oracle.py)
    oracle: DepthOracle | None = None


@dataclass(frozen=True)
class TokenProbs:
    """An emitted token's probability and the ``n_probs`` likeliest tokens at its position,
    from the target's raw logits (llama-server's pre-sampling ``n_probs``): what the model
    thought before the request's samplers cut and reshaped the distribution."""

    prob: float
    top: tuple[tuple[int, float], ...]  # (token, probability), likeliest first


@dataclass
class TokenEvent:
    """One emitted piece of text, for streaming (stop strings already held back)."""

    token: int
    text: str
    probs: TokenProbs | None = None  # when the request asked for n_probs


@dataclass
class DraftStats:
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class Rejection:
    """A draft the target cut short: what came before it, what was drafted, and the target's
    own tokens at the draft's rows (the accepted ones, then its token where it disagreed)."""

    source: str  # "draft" (the draft model) or an n-gram source
    context: list[int]  # the tokens before the draft (their tail)
    draft: list[int]
    target: list[int]
    context_text: str
    draft_text: str
    target_text: str


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stop_type: StopType
    stopping_word: str = ""
    n_prompt: int = 0  # prompt length
    n_cached: int = 0  # prompt tokens reused from the slot's cache (target)
    n_evaluated: int = 0  # prompt tokens the target evaluated for this request
    draft_n_cached: int = 0
    draft_n_evaluated: int = 0
    n_shifted: int = 0  # of n_cached, tokens moved by a KV shift (chunk/tail reuse)
    # prompt tokens whose KV a cold evaluation would compute differently (from the first token
    # moved by a KV shift, now or earlier, on): 0 means the answer is a cold cache's
    n_approx: int = 0
    draft_n_shifted: int = 0
    # the draft model's prompt window is evaluated lazily, at its first draft; that time is
    # prompt work, so it counts in prompt_ms (and not in predicted_ms or t_draft_ms).
    # Pipelined, the draft thread evaluates it while the target works: reported here, not
    # added to prompt_ms nor taken out of predicted_ms (it took no wall time of its own)
    draft_prompt_ms: float = 0.0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    drafted: dict[str, DraftStats] = field(default_factory=dict)  # by source: draft, ngram
    t_draft_ms: float = 0.0  # pipelined: the draft thread's decode time (concurrent)
    t_verify_ms: float = 0.0
    t_sample_ms: float = 0.0
    t_outside_ms: float = 0.0  # wall time not spent inside llama.cpp calls
    cancelled: bool = False
    pipelined: bool = False  # the draft model ran on its own thread
    threads: tuple[int, int] = (0, 0)  # the target's threads at the end: single tokens, batches
    probs: list[TokenProbs] = field(default_factory=list)  # per token, when n_probs > 0
    draft_n_decoded: int = 0  # draft tokens the draft model decoded (pipelined: incl. wasted)
    # tokens drawn from another completion's rows while its tokens equalled this one's (a
    # request's completions share one sequence until they part: no batch rows of their own)
    n_followed: int = 0
    # one entry per speculative step: (source, drafted, accepted); for stats and tests
    spec_steps: list[tuple[str, int, int]] = field(default_factory=list)
    # drafts the target cut short, when SpecSettings.record_rejections is on
    rejections: list[Rejection] = field(default_factory=list)
    draft_n_relaxed: int = 0  # accepted drafted tokens the target would not have drawn (topk)

    @property
    def draft_n(self) -> int:
        return sum(s.drafted for s in self.drafted.values())

    @property
    def draft_n_accepted(self) -> int:
        return sum(s.accepted for s in self.drafted.values())


TokenCallback = Callable[[TokenEvent], None]
# (completion index, event): the stream of a request with several completions
IndexedTokenCallback = Callable[[int, TokenEvent], None]
