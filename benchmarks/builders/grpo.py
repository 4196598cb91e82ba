"""Builds TRL's or ours GRPOTrainer for one GRPO benchmark configuration.

Both get the same prompts (token ids drawn from the seed, `prompt_length` each; the text
tokenisation is bypassed as for DPO: TRL through a subclass whose `_tokenize_prompts`
looks the ids up by the row's key, ours through a subclass whose `_prepare_split` takes
the `prompt_ids` and `row_index` columns its prompt tokenisation would have made), the
same lengths and the same deterministic reward, and both are configured with TRL's
argument names: num_generations, max_completion_length, per_device_train_batch_size
(completions per micro-batch), gradient_accumulation_steps, steps_per_generation, beta,
loss_type, temperature.

The reward is a function of the completion's token ids alone: the share of its tokens
drawn from the lower half of the vocabulary (so the G completions of a prompt differ in
reward and every group has an advantage to learn from).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GRPORun:
    """One configuration: which trainer, and its generation path."""

    name: str
    trainer: str                      # "trl" or "ours"
    continuous_batching: bool = False  # TRL: use_transformers_continuous_batching
    compile_generation: bool = False   # ours: the decoding step compiled (StaticDecode's, or generate's)
    generation_backend: str = "auto"   # ours: auto (StaticDecode on CUDA), generate or static
    compile_layers: bool = False       # ours: each decoder layer torch.compile'd (element-wise ops recomputed)
    padding_free: bool = False         # ours: packed rows of whole completions up to --max_tokens_per_batch
    share_prompt: bool = False         # ours, with padding_free: each group's prompt once
    fused_sampling: bool = False       # ours (static): the draw inside the head's forward
    decode_kernel: str = "auto"        # ours (static): the decoding step's grouped attention (auto: Triton on CUDA)
    fuse_projections: bool = False     # ours (static): q/k/v and gate/up as one GEMM each while decoding
    micro_batch: int | None = None     # per_device_train_batch_size for this configuration (None: the flag's)
    generation_max_rows: int = 0       # ours: completions decoded at once (0: the whole generation batch)
    tiled_mlp_tokens: int = 0          # ours: each decoder layer's MLP over tiles of this many tokens (0: whole)
    about: str = ""


RUNS = {r.name: r for r in (
    GRPORun("trl", "trl", about="trl.GRPOTrainer, transformers generate (dynamic cache, compilation off), no vLLM"),
    GRPORun("trl_micro1", "trl", micro_batch=1,
            about="trl.GRPOTrainer with per_device_train_batch_size=1 (gradient accumulation over the step's "
                  "completions): what a TRL user picks for the longest completions, one completion's activations "
                  "at the peak"),
    GRPORun("trl_continuous", "trl", continuous_batching=True,
            about="trl.GRPOTrainer, use_transformers_continuous_batching=True (not run unless named)"),
    GRPORun("ours", "ours", about="fusedalign.trainers.grpo.GRPOTrainer, its default generator (on CUDA: "
                                  "StaticDecode, a static cache and one CUDA graph replay a token)"),
    GRPORun("ours_compile", "ours", compile_layers=True,
            about="ours with compile_layers=True: decoder layers compiled, element-wise ops recomputed in the backward"),
    GRPORun("ours_generate", "ours", generation_backend="generate",
            about="ours with generation_backend='generate': transformers' generate, as TRL"),
    GRPORun("ours_compiled", "ours", compile_generation=True,
            about="ours with compile_generation=True: StaticDecode's step compiled by inductor, then captured"),
    GRPORun("ours_generate_compiled", "ours", compile_generation=True, generation_backend="generate",
            about="ours with generation_backend='generate' and compile_generation=True: generate's static cache "
                  "and compiled decoding"),
    GRPORun("ours_fast", "ours", compile_generation=True, fused_sampling=True, decode_kernel="triton",
            generation_backend="static",
            about="ours with every decoding lever: the step compiled, the draw inside the head (fused_sampling), "
                  "the Triton attention kernel (decode_kernel='triton'); CUDA only"),
    GRPORun("ours_compiled_triton", "ours", compile_generation=True, decode_kernel="triton", generation_backend="static",
            about="ours with the fastest decoding step measured (71009fc, H100): compiled, with the Triton attention "
                  "kernel, the draw from the logits; CUDA only"),
    GRPORun("ours_compiled_triton_fused_projections", "ours", compile_generation=True, decode_kernel="triton",
            generation_backend="static", fuse_projections=True,
            about="ours_compiled_triton with each layer's q/k/v and gate/up projections as one GEMM each while "
                  "decoding (fuse_projections=True); CUDA only"),
    GRPORun("ours_fastest", "ours", compile_generation=True, generation_backend="static", fuse_projections=True,
            compile_layers=True,
            about="ours_compiled_triton_fused_projections (the Triton kernels by default on CUDA) with "
                  "compile_layers=True: the training forwards' element-wise work fused too, where the step's "
                  "time outside generation is 72% at the fastest (bda33d2, H100)"),
    GRPORun("ours_padding_free", "ours", padding_free=True,
            about="ours with padding_free=True: each step's completions in packed rows up to the token budget"),
    GRPORun("ours_shared_prompt", "ours", padding_free=True, share_prompt=True,
            about="ours with padding_free=True and share_prompt=True: a group's prompt once in its packed row"),
    GRPORun("ours_shared_prompt_rows2", "ours", padding_free=True, share_prompt=True, generation_max_rows=2,
            about="ours_shared_prompt with generation_max_rows=2: the rollout decodes two completions at a time, "
                  "its KV cache two rows rather than the generation batch"),
    GRPORun("ours_shared_prompt_rows2_tiled", "ours", padding_free=True, share_prompt=True, generation_max_rows=2,
            tiled_mlp_tokens=896,
            about="ours_shared_prompt_rows2 with tiled_mlp_tokens=896 (the hidden size): each layer's MLP over tiles "
                  "of 896 tokens, each tile checkpointed, so a layer's recompute holds one tile's MLP activations"),
    GRPORun("ours_shared_prompt_rows1_tiled_compile", "ours", padding_free=True, share_prompt=True,
            generation_max_rows=1, tiled_mlp_tokens=896, compile_layers=True,
            about="ours_shared_prompt_rows2_tiled decoding one completion at a time, with compile_layers=True: "
                  "inductor recomputes the norms' float32 copies and the other element-wise work in the backward, "
                  "so a layer's recompute saves less a token (benchmarks/layer_saved_bytes.py)"),
    GRPORun("ours_shared_prompt_compiled", "ours", padding_free=True, share_prompt=True, compile_generation=True,
            about="ours_shared_prompt with compile_generation=True: the decoding step compiled, then captured (at "
                  "realistic lengths a generation is its longest row's steps, most of them at a small batch, where "
                  "the uncompiled step's fixed cost dominates)"),
    GRPORun("ours_shared_prompt_compile", "ours", padding_free=True, share_prompt=True, compile_layers=True,
            about="ours_shared_prompt with compile_layers=True: the element-wise work of each decoder layer fused, "
                  "fewer launches a packed row"),
)}
DEFAULT = ("trl", "ours")


def availability(device: str) -> dict[str, str | None]:
    """Why each configuration cannot run here (None: it can)."""
    reasons: dict[str, str | None] = {}
    try:
        import trl

        trl_reason = None if hasattr(trl.GRPOTrainer, "_tokenize_prompts") else (
            f"trl {trl.__version__}'s GRPOTrainer has no _tokenize_prompts (written against trl 1.16)")
    except Exception as e:  # noqa: BLE001
        trl_reason = f"`import trl` failed: {type(e).__name__}: {e}"
    try:
        from fusedalign.trainers.grpo import GRPOTrainer  # noqa: F401

        ours_reason = None
    except ImportError as e:
        ours_reason = f"fusedalign.trainers.grpo does not import yet ({e})"
    for run in RUNS.values():
        reasons[run.name] = trl_reason if run.trainer == "trl" else ours_reason
        if run.decode_kernel == "triton" and device != "cuda" and not reasons[run.name]:
            reasons[run.name] = "CUDA only (the Triton decode kernel)"
        if run.continuous_batching and not reasons[run.name]:
            from transformers import GenerationMixin

            if not hasattr(GenerationMixin, "generate_batch"):
                reasons[run.name] = "this transformers has no generate_batch"
    return reasons


def prompt_rows(s, vocab: int) -> list[list[int]]:
    """prompts_per_step x total_steps prompts of prompt_length ids (never id 0, pad/eos)."""
    import numpy as np

    rng = np.random.default_rng([s.seed, 3])
    return rng.integers(1, vocab, size=(s.prompts * s.total_steps, s.prompt_length)).tolist()


def lower_half_reward(vocab: int):
    """The benchmark's reward: the share of completion tokens below vocab / 2."""
    half = vocab // 2

    def lower_half(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
        return [sum(t < half for t in ids) / max(len(ids), 1) for ids in completion_ids]

    return lower_half


def micro_batch_of(run: GRPORun, s) -> int:
    """The configuration's own micro-batch (trl_micro1's 1), else the flag's."""
    return run.micro_batch if run.micro_batch is not None else s.per_device_train_batch_size


def rows_decoded_at_once(run: GRPORun, s) -> int:
    """The completions a configuration's rollout decodes together: the generation batch (both
    trainers generate a step's --prompts x --num_generations at once here: `steps_per_generation`
    is the step's micro-batches), or ours' generation_max_rows where set."""
    completions = s.prompts * s.num_generations
    return min(completions, run.generation_max_rows) if run.generation_max_rows else completions


def apply_micro_batch(run: GRPORun, s) -> None:
    """The worker's settings with `micro_batch_of`: `grpo_args` then divides the step's completions
    into that many accumulation steps."""
    s.per_device_train_batch_size = micro_batch_of(run, s)


def micro_batch_words(configs, s) -> str:
    """For the tables' titles: "micro-batch 8", and the configurations with a micro-batch of their own."""
    own = "".join(f"; {c}'s {RUNS[c].micro_batch}" for c in configs if RUNS[c].micro_batch is not None)
    return f"micro-batch {s.per_device_train_batch_size}{own}"


WEIGHTS = {"bf16": "bfloat16", "fp32": "float32"}  # the policy's weights, given to both trainers by name


def grpo_args(s, output_dir: str) -> dict:
    """TRL's names, the same values for both trainers."""
    completions = s.prompts * s.num_generations
    return dict(
        output_dir=output_dir, num_generations=s.num_generations, max_completion_length=s.new_tokens,
        per_device_train_batch_size=s.per_device_train_batch_size,
        gradient_accumulation_steps=completions // s.per_device_train_batch_size,
        steps_per_generation=completions // s.per_device_train_batch_size,
        beta=s.beta, loss_type=s.loss_type, temperature=1.0, learning_rate=s.learning_rate,
        max_steps=s.total_steps, bf16=s.dtype == "bf16", seed=s.seed, data_seed=s.seed,
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=s.gradient_checkpointing, report_to="none", save_strategy="no", eval_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        **({"gradient_checkpointing_kwargs": {"use_reentrant": False, "offload": True}}
           if getattr(s, "checkpoint_offload", False) else {}),
    )


def offload_unavailable(device: str) -> str | None:
    """Why transformers' checkpoint offload (gradient_checkpointing_kwargs={"offload": True}: the
    checkpointed layers' inputs held in pinned host memory) cannot run here, or None."""
    import inspect

    import transformers.modeling_utils

    if "save_on_cpu" not in inspect.getsource(transformers.modeling_utils):
        return f"transformers {transformers.__version__} has no checkpoint offload (it came in 5.17)"
    if device != "cuda":
        return "checkpoint offload pins host memory, which needs a GPU"
    return None


def checkpointing_words(s) -> str:
    """How the backbone keeps its activations, for the tables' titles."""
    if not s.gradient_checkpointing:
        return "gradient checkpointing off"
    return "gradient checkpointing on" + (", its layers' inputs in host memory" if s.checkpoint_offload else "")


def random_completions(s, vocab: int):
    """For memory searches: n completions of exactly max_completion_length random ids (never 0, the
    EOS), drawn from the seed and a call counter, the same for both trainers."""
    import numpy as np

    calls = [0]

    def draw(n: int) -> list[list[int]]:
        calls[0] += 1
        rng = np.random.default_rng([s.seed, 7, calls[0]])
        return rng.integers(1, vocab, size=(n, s.new_tokens)).tolist()

    return draw


def build(run: GRPORun, s, output_dir: str, prompts: list[list[int]], tokenizer, callback, timers, vocab: int):
    """The trainer for `run`; `timers("generation")` wraps every generation call."""
    reward = lower_half_reward(vocab)
    s.draw = random_completions(s, vocab) if getattr(s, "random_completions", False) else None
    if run.trainer == "trl":
        return build_trl(run, s, output_dir, prompts, tokenizer, callback, timers, reward)
    return build_ours(run, s, output_dir, prompts, tokenizer, callback, timers, reward)


def build_trl(run, s, output_dir, prompts, tokenizer, callback, timers, reward):
    import trl
    from datasets import Dataset

    class BenchTRLGRPOTrainer(trl.GRPOTrainer):
        def _tokenize_prompts(self, keys):
            return [prompts[int(k)] for k in keys], None, {}  # the rows are token ids already

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            with timers("generation"):
                if s.draw is not None:
                    return s.draw(len(prompt_ids)), None
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    kwargs = grpo_args(s, output_dir)
    kwargs["model_init_kwargs"] = {"dtype": "bfloat16" if s.dtype == "bf16" else "float32", "device_map": None}
    kwargs["use_cpu"] = s.device == "cpu"
    if run.continuous_batching:
        kwargs["use_transformers_continuous_batching"] = True
    dataset = Dataset.from_dict({"prompt": [str(i) for i in range(len(prompts))]})
    return BenchTRLGRPOTrainer(model=s.model_dir, reward_funcs=reward, args=trl.GRPOConfig(**kwargs),
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])


def packing_args(s, **flags) -> dict:
    """Ours' packed-row arguments (GRPO's and distillation's): padding_free, `flags`, and the
    --max_tokens_per_batch budget when given (0: one prompt + completion's row, the smallest
    budget that trains)."""
    packing = dict(padding_free=True, **flags)
    if s.max_tokens_per_batch is not None:
        packing["max_tokens_per_batch"] = s.max_tokens_per_batch or s.prompt_length + s.new_tokens
    return packing


def build_ours(run, s, output_dir, prompts, tokenizer, callback, timers, reward):
    from datasets import Dataset

    from fusedalign.configs.grpo import GRPOConfig
    from fusedalign.trainers.grpo import GRPOTrainer
    from fusedalign.trainers.rollout_types import Split

    class BenchGRPOTrainer(GRPOTrainer):
        @staticmethod
        def _prepare_split(dataset, tokenizer, args, reward_funcs):
            # The columns its prompt tokenisation makes are already there: prompt_ids, row_index.
            return dataset, None if dataset is None else Split(conversational=False)

    packing = packing_args(s, share_prompt=run.share_prompt) if run.padding_free else {}
    args = GRPOConfig(**grpo_args(s, output_dir), model_init_kwargs={"dtype": WEIGHTS[s.dtype]},
                      compile_generation=run.compile_generation,
                      generation_backend=run.generation_backend, compile_layers=run.compile_layers,
                      fused_sampling=run.fused_sampling, decode_kernel=run.decode_kernel,
                      fuse_projections=run.fuse_projections, generation_max_rows=run.generation_max_rows,
                      tiled_mlp_tokens=run.tiled_mlp_tokens, **packing)
    index = list(range(len(prompts)))
    rows = Dataset.from_dict({"prompt": [str(i) for i in index], "prompt_ids": prompts, "row_index": index})
    trainer = BenchGRPOTrainer(model=s.model_dir, reward_funcs=[reward], args=args, train_dataset=rows,
                               processing_class=tokenizer, callbacks=[callback])
    generator = getattr(trainer, "generator", None)
    if generator is not None and hasattr(generator, "generate"):
        generate = generator.generate

        def timed_generate(model, prompt_ids, *a, **kw):
            from fusedalign.generation import GenerationOutput

            with timers("generation"):
                if s.draw is not None:
                    return GenerationOutput(s.draw(len(prompt_ids)), [True] * len(prompt_ids))
                return generate(model, prompt_ids, *a, **kw)

        generator.generate = timed_generate
    return trainer
