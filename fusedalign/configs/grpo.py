"""GRPOConfig: the arguments of `fusedalign grpo` and `GRPOTrainer`, with TRL 1.16's names and defaults.

Departures from TRL's `_BaseConfig` defaults, on purpose, as for every fusedalign trainer
(`configs/common.py`): `bf16` on only where a CUDA device supports it, `gradient_checkpointing`
off (a GRPO step is mostly generation, which never checkpoints; turn it on for long
completions), `logging_steps` 1. Also:
- `max_prompt_length` (TRL 1.16 has no such field: prompts are never truncated) defaults to
  None, the same behaviour; set it to keep the last N prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusedalign.configs.common import FusedAlignConfig, _init_kwargs, check_choice
from fusedalign.configs.packed import GROUPS_BUDGET_HELP, PADDING_FREE_HELP, check_packed_batching
from fusedalign.distributed import check_compile_generation_supported
from fusedalign.generation.decode_attention import KERNEL_CHOICES
from fusedalign.losses.grpo_advantages import AGGREGATIONS, SCALE_REWARDS
from fusedalign.losses.grpo_policy import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, GRPOOptions

GENERATION_BACKENDS = ("auto", "generate", "static")


@dataclass
class GRPOConfig(FusedAlignConfig):
    """Group Relative Policy Optimization (Shao et al., 2024) and its loss variants."""

    output_dir: str | None = field(default="outputs/grpo")
    learning_rate: float = field(default=1e-6)
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Accepted as in TRL; either value trains the same: the prompt and every "
                                         "other column reach the reward functions."})
    disable_dropout: bool = field(default=False, metadata={"help": "Set dropout to 0 in the policy and reference."})
    max_length: int | None = field(default=None, metadata={"help": "Unused here: lengths are bounded by "
                                                                   "max_prompt_length and max_completion_length."})
    # ---------------------------------------------------------------- data and rewards
    max_prompt_length: int | None = field(default=None, metadata={"help": "Keep the last N prompt tokens; None: all."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: built-in short names (zen_words, vowels, ends_with_period, length), "
                  "dotted paths 'package.module.function', or reward-model paths."},
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A sequence-classification reward model (num_labels=1), scored first."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "One weight per reward function; "
                                                                               "None: all 1.0."})
    multi_objective_aggregation: str = field(default="sum_then_normalize",
                                             metadata={"help": "sum_then_normalize or normalize_then_sum (GDPO)."})
    scale_rewards: str = field(default="group", metadata={"help": "group, batch or none (True/False: group/none)."})
    # ---------------------------------------------------------------- generation
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (G, >= 2)."})
    num_generations_eval: int | None = field(default=None, metadata={"help": "G in evaluation; None: num_generations."})
    max_completion_length: int = field(default=512, metadata={"help": "Max new tokens of a completion."})
    generation_batch_size: int | None = field(
        default=None, metadata={"help": "Completions generated at once over all ranks; None: per-device batch x "
                                "ranks x steps_per_generation."})
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "Micro-batches per generation, per rank; None: gradient_accumulation_steps."})
    # ---------------------------------------------------------------- packed rows (TRL 1.16 has none of these)
    padding_free: bool = field(
        default=False,
        metadata={"help": PADDING_FREE_HELP + " Each micro-batch of completions is one row; the policy, old-policy "
                  "and reference passes all read it."})
    share_prompt: bool = field(
        default=False,
        metadata={"help": "With padding_free: the completions of one prompt in a micro-batch share one copy of it, "
                  "each attending to the prompt and itself only, positions continuing from the prompt (P + sum C "
                  "tokens a group instead of G x P + sum C). Needs an attention implementation that takes a mask "
                  "(flex_attention, sdpa, eager)."})
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": GROUPS_BUDGET_HELP.format(
            note=" (bnpo, defined per micro-batch, keeps each micro-batch's completions; top_entropy_quantile "
                 "keeps each micro-batch in one row)")})
    temperature: float = field(default=1.0)
    top_p: float = field(default=1.0)
    top_k: int = field(default=0, metadata={"help": "0: no top-k filtering."})
    min_p: float | None = field(default=None)
    repetition_penalty: float = field(default=1.0)
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "More transformers GenerationConfig fields: a dict, or its JSON "
                                "('{\"do_sample\": false}' on the command line)."})
    cache_implementation: str | None = field(default=None, metadata={"help": "generate's cache, e.g. 'static'."})
    compile_generation: bool = field(
        default=False, metadata={"help": "Compile the decoding step (not in TRL, which disables compile). static: "
                                 "StaticDecode's step through torch.compile before its CUDA graph, once a run, on "
                                 "every backend (not with keyed_sampling). generate: its static cache with "
                                 "compiled decoding, not under ZeRO-3 or FSDP2 (it keeps the weights' storage)."})
    generation_backend: str = field(
        default="auto",
        metadata={"help": "generate: transformers' generate (TRL's path without vLLM); static: fusedalign's decoding "
                  "loop on a static KV cache, each token one CUDA graph replay on a GPU, the same sampling "
                  "(falls back to generate for sliding-window models or other than eager/sdpa attention); "
                  "auto: static on a CUDA device unless generate-only options are set, else generate."})
    fused_sampling: bool = field(
        default=False, metadata={"help": "static only (not in TRL): draw each token inside the output head's forward, "
                                 "a slice of the vocabulary at a time, instead of from the [B, V] logits: the same "
                                 "tokens; with top-k, top-p or min-p the draw stays on the logits."})
    decode_kernel: str = field(
        default="auto", metadata={"help": "static loop only (not in TRL): what computes a decoding step's grouped "
                                  "attention: triton (fusedalign's kernel, CUDA; a sampled token is then drawn by its "
                                  "Triton draw kernel too), sdpa (cuDNN's), or auto (the default: triton on CUDA where "
                                  "Triton is installed, else sdpa)."})
    fuse_projections: bool = field(
        default=False, metadata={"help": "static only (not in TRL): while generating, each layer's q/k/v projections "
                                 "as one GEMM and its gate/up projections as another (Llama, Qwen2/3, Mistral, "
                                 "Gemma/Gemma2 forms; plain linear layers); the same math, fewer small GEMMs."})
    generation_max_rows: int = field(
        default=0, metadata={"help": "Not in TRL: decode at most this many completions at once, the generation batch in "
                             "consecutive parts (0: all at once). The rollout's KV cache then holds this many rows, "
                             "which sets the peak memory at long completions (vLLM's max_num_seqs); the same tokens "
                             "for greedy and keyed sampling."})
    keyed_sampling: bool = field(
        default=False, metadata={"help": "Draw tokens by key (seed, step, row, generation, position): the same "
                                 "completions on any split over ranks and batches."})
    replay_completions: str | None = field(
        default=None, metadata={"help": "Replay completions recorded in this JSON-lines file instead of generating."})
    log_completions: bool = field(
        default=False, metadata={"help": "At each logging step, print a table of the prompts, completions and rewards "
                                 "generated since the last one and append them to OUTPUT_DIR/completions.jsonl."})
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Rows of that table printed (None: all); the file keeps every one."})
    shuffle_dataset: bool = field(default=True, metadata={"help": "Draw the prompts in a seeded random order "
                                                              "(the same on every rank); False: in dataset order."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Leave completions without EOS out "
                                                                            "of the loss (DAPO)."})
    # ---------------------------------------------------------------- loss
    loss_type: str = field(default="dapo", metadata={"help": "One of: " + ", ".join(LOSS_TYPES) + "."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; 0 loads no reference model."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip: ratio >= 1 - epsilon."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clip 1 + epsilon_high (None: epsilon; DAPO: 0.28); for cispo the cap "
                                "on the ratio (ScaleRL: 5.0)."})
    delta: float | None = field(default=None, metadata={"help": "Two-sided clip: cap the unclipped ratio at delta "
                                                              "(> 1; INTELLECT-2 recommends > 1 + epsilon)."})
    importance_sampling_level: str = field(default="token", metadata={"help": "token or sequence (GSPO)."})
    num_iterations: int = field(default=1, metadata={"help": "Updates per generation batch (mu)."})
    use_bias_correction_kl: bool = field(default=True, metadata={"help": "Multiply the k3 KL by the ratio."})
    sapo_temperature_pos: float = field(default=1.0)
    sapo_temperature_neg: float = field(default=1.05)
    vespo_k_pos: float = field(default=2.0)
    vespo_lambda_pos: float = field(default=3.0)
    vespo_k_neg: float = field(default=3.0)
    vespo_lambda_neg: float = field(default=2.0)
    top_entropy_quantile: float = field(default=1.0, metadata={"help": "Keep the top rho of tokens by entropy in "
                                                                       "the policy loss; 1.0 keeps all."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus coefficient (negative: an entropy "
                                                                "penalty, as in TRL)."})
    ref_model_name_or_path: str | None = field(default=None, metadata={"help": "Default: the policy's own path."})

    def __post_init__(self):
        self.scale_rewards = {True: "group", False: "none", "true": "group", "false": "none"}.get(
            self.scale_rewards, self.scale_rewards)
        self.generation_kwargs = _init_kwargs(self.generation_kwargs, "generation_kwargs", '{"do_sample": false}')
        super().__post_init__()
        self._check_choices()
        self._check_numbers()
        self._check_batches()
        self._check_packed()
        self.loss_options()  # loss-level checks (dr_grpo's constant ...)

    def _check_choices(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        check_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        check_choice("multi_objective_aggregation", self.multi_objective_aggregation, AGGREGATIONS)
        check_choice("generation_backend", self.generation_backend, GENERATION_BACKENDS)
        generate_only = [flag for flag, on in (("generation_kwargs", self.generation_kwargs),
                                               ("cache_implementation", self.cache_implementation)) if on]
        if self.generation_backend == "static" and generate_only:
            raise ValueError(f"--{generate_only[0]} is an option of transformers' generate; use "
                             "--generation_backend generate (or auto) with it, or drop it.")
        if self.replay_completions is not None and self.keyed_sampling:
            raise ValueError("--replay_completions replays recorded completions; it cannot be combined with "
                             "--keyed_sampling (which samples new ones)")
        check_choice("decode_kernel", self.decode_kernel, KERNEL_CHOICES)
        static_only = [flag for flag, on in (("fused_sampling", self.fused_sampling),
                                             ("decode_kernel", self.decode_kernel != "auto"),
                                             ("fuse_projections", self.fuse_projections)) if on]
        if static_only and self.resolved_generation_backend == "generate":
            why = ("--generation_backend generate" if self.generation_backend == "generate"
                   else "--generation_backend auto, which picks generate here (no CUDA device, or a generate-only "
                        "option)")
            raise ValueError(f"--{static_only[0]} is an option of the static decoding loop; {why} does not use it: "
                             "pass --generation_backend static, or drop the flag.")
        if self.compile_generation and self.resolved_generation_backend == "generate":
            check_compile_generation_supported()

    def _check_numbers(self) -> None:
        def need(ok: bool, flag: str, expected: str, value: object) -> None:
            if not ok:
                raise ValueError(f"{flag} must be {expected}; got {value!r}.")

        need(self.max_completion_length >= 1, "max_completion_length", ">= 1", self.max_completion_length)
        need(self.max_prompt_length is None or self.max_prompt_length >= 1, "max_prompt_length", ">= 1 or None",
             self.max_prompt_length)
        need(self.temperature > 0, "temperature", "> 0", self.temperature)
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        need(self.top_k >= 0, "top_k", ">= 0 (0: off)", self.top_k)
        need(self.min_p is None or 0 <= self.min_p <= 1, "min_p", "in [0, 1] or None", self.min_p)
        need(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        need(self.beta >= 0, "beta", ">= 0", self.beta)
        need(self.epsilon >= 0, "epsilon", ">= 0 (the lower clip is 1 - epsilon; 1 or more turns it off)", self.epsilon)
        need(self.epsilon_high is None or self.epsilon_high >= 0, "epsilon_high", ">= 0 or None", self.epsilon_high)
        need(self.delta is None or self.delta > 1, "delta", "> 1 or None (the cap on the unclipped ratio)", self.delta)
        need(self.num_iterations >= 1, "num_iterations", ">= 1", self.num_iterations)
        need(self.generation_max_rows >= 0, "generation_max_rows", ">= 0 (0: the whole generation batch at once)",
             self.generation_max_rows)
        need(self.num_completions_to_print is None or self.num_completions_to_print >= 0, "num_completions_to_print",
             ">= 0 or None", self.num_completions_to_print)
        need(0 <= self.top_entropy_quantile <= 1, "top_entropy_quantile", "in [0, 1]", self.top_entropy_quantile)
        need(self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0, "sapo_temperature_pos/neg", "> 0",
             (self.sapo_temperature_pos, self.sapo_temperature_neg))
        if self.reward_weights is not None and (self.reward_funcs or self.reward_model_name_or_path):
            n = len(self.reward_funcs or []) + bool(self.reward_model_name_or_path)
            if len(self.reward_weights) != n:
                raise ValueError(f"reward_weights has {len(self.reward_weights)} values for {n} reward functions "
                                 f"(reward_model_name_or_path, then reward_funcs); give one weight per function.")

    def _check_batches(self) -> None:
        if self.auto_find_batch_size:
            raise ValueError("auto_find_batch_size is not supported by GRPO: shrinking the batch breaks the groups "
                             "of num_generations completions; lower per_device_train_batch_size instead.")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (advantages compare completions of one prompt); "
                             f"got {self.num_generations}.")
        global_batch = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("set generation_batch_size or steps_per_generation, not both (one follows from the other).")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ValueError(f"steps_per_generation must be >= 1; got {self.steps_per_generation}.")
        if self.generation_batch_size is None:
            self.steps_per_generation = self.steps_per_generation or self.gradient_accumulation_steps
            self.generation_batch_size = global_batch * self.steps_per_generation
        elif self.generation_batch_size % global_batch:
            raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                             f"per_device_train_batch_size x ranks ({global_batch}).")
        else:
            self.steps_per_generation = self.generation_batch_size // global_batch
        if self.generation_batch_size % self.num_generations:
            raise ValueError(f"num_generations ({self.num_generations}) must divide generation_batch_size "
                             f"({self.generation_batch_size} = per_device_train_batch_size x ranks x "
                             f"steps_per_generation), so that every prompt's group is generated whole.")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(f"num_generations_eval must be >= 1; got {self.num_generations_eval}.")
        if self.do_eval and self.eval_strategy != "no":
            g = self.num_generations_eval or self.num_generations
            if (self.per_device_eval_batch_size * self.world_size) % g:
                raise ValueError(f"num_generations_eval ({g}) must divide per_device_eval_batch_size x ranks "
                                 f"({self.per_device_eval_batch_size * self.world_size}).")

    def _check_packed(self) -> None:
        check_packed_batching(self, "completion")
        budget = self.max_tokens_per_batch
        if budget is not None and self.max_prompt_length is not None:
            longest = self.max_prompt_length + self.max_completion_length
            if budget < longest:
                raise ValueError(f"max_tokens_per_batch={budget} cannot hold one completion of max_prompt_length + "
                                 f"max_completion_length = {longest} tokens; raise it to at least {longest}.")

    @property
    def resolved_generation_backend(self) -> str:
        """"generate" or "static": what `auto` means for this run (static on CUDA, unless an
        option only generate has is set)."""
        if self.generation_backend != "auto":
            return self.generation_backend
        if self.generation_kwargs or self.cache_implementation:
            return "generate"
        return "static" if self.device.type == "cuda" else "generate"

    def loss_options(self) -> GRPOOptions:
        """The options the loss functions read."""
        return GRPOOptions.from_args(self)

    @property
    def needs_old_logps(self) -> bool:
        """Whether some micro-batch is trained on after an optimizer step since its generation, so
        that the generating policy's log-probs must be computed (TRL's rule): a generation is
        used over steps_per_generation x num_iterations micro-batches, and is off-policy unless
        those fit in whole optimizer steps of gradient_accumulation_steps micro-batches."""
        return self.gradient_accumulation_steps % (self.steps_per_generation * self.num_iterations) != 0
