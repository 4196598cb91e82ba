"""StaticDecode: the same completions as transformers' generate (greedy, keyed, penalised), the same
sampling distribution, the fallback, the GRPO flag; on CUDA (skipped without), one CUDA graph a token."""

from __future__ import annotations

import pytest
import torch

from fusedalign.configs import GRPOConfig
from fusedalign.generation import HFGenerate, KeyedSampler, StaticDecode
from fusedalign.generation.static import gumbel_max, process_logits
from fusedalign.models import load_model, load_tokenizer

PROMPT_LENGTHS = (3, 7, 5, 1, 9)  # left padding of every amount, a one-token prompt


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 400, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _keys(n: int) -> list[tuple[int, int]]:
    return [(i, i % 2) for i in range(n)]


def _kw(tok, **more) -> dict:
    return dict(max_new_tokens=14, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **more)


@pytest.mark.parametrize("name,attn", [("builtin:tiny-qwen2", "sdpa"), ("builtin:tiny-qwen2", "eager"),
                                       ("builtin:tiny-llama", "sdpa")])
@pytest.mark.parametrize("flags", [dict(do_sample=False), dict(do_sample=False, repetition_penalty=1.4),
                                   dict(temperature=0.7, top_k=30, top_p=0.9, min_p=0.02, keyed=True),
                                   # Filters left off: a token at top-k's boundary can tie within the
                                   # rounding of the two loops' attention and flip in or out.
                                   dict(repetition_penalty=1.5, keyed=dict(temperature=0.7))],
                         ids=["greedy", "penalty", "keyed", "keyed_penalty"])
def test_completions_equal_generates(name, attn, flags):
    """Greedy (with and without the repetition penalty over prompt and completion) and keyed
    sampling: every token, the truncation flags and the sampler's log-probs as generate's."""
    if flags.get("repetition_penalty") and not _generate_ignores_padding_in_penalty():
        pytest.skip("this transformers' generate counts the left padding in the repetition penalty")
    model, tok = load_model(name, attn_implementation=attn).eval(), load_tokenizer(name)
    flags = dict(flags)
    keyed = flags.pop("keyed", False)
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))

    def sampler():
        if not keyed:
            return None
        return KeyedSampler(3, **(keyed if isinstance(keyed, dict) else
                                  dict(temperature=0.7, top_k=30, top_p=0.9, min_p=0.02)))

    want = HFGenerate(**_kw(tok, sampler=sampler(), **flags)).generate(model, prompts, keys, step=2)
    decode = StaticDecode(**_kw(tok, sampler=sampler(), **flags))
    got = decode.generate(model, prompts, keys, step=2)
    assert decode.last_call["path"] == "static" and decode.last_call["graph"] is False
    assert got.completion_ids == want.completion_ids
    assert got.truncated == want.truncated
    assert any(len(c) > 3 for c in got.completion_ids)
    if keyed:
        for a, b in zip(got.logprobs, want.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def _generate_ignores_padding_in_penalty() -> bool:
    import inspect

    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    return "prompt_ignore_length" in inspect.signature(RepetitionPenaltyLogitsProcessor.__init__).parameters


@pytest.mark.parametrize("keyed", [False, True], ids=["greedy", "keyed"])
def test_the_repetition_penalty_ignores_a_rows_padding(keyed):
    """A row decodes the same alone as left-padded in a batch: the penalty counts its prompt's
    tokens, not the padding (which is the EOS id of many tokenizers)."""
    model, tok = load_model("builtin:tiny-qwen2").eval(), load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))

    def decode(rows, row_keys):
        sampler = KeyedSampler(3, temperature=0.7) if keyed else None
        return StaticDecode(**_kw(tok, do_sample=keyed, repetition_penalty=3.0, sampler=sampler)).generate(
            model, rows, row_keys, step=2)

    together = decode(prompts, keys)
    for i in range(len(prompts)):
        alone = decode([prompts[i]], [keys[i]])
        assert alone.completion_ids[0] == together.completion_ids[i], i
        if keyed:
            torch.testing.assert_close(torch.tensor(alone.logprobs[0]), torch.tensor(together.logprobs[i]),
                                       rtol=0, atol=1e-5)


def test_a_finished_row_gets_padding_and_the_loop_stops_early():
    model, tok = load_model("builtin:tiny-qwen2").eval(), load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    # Declare as EOS the token each row draws second: every row ends within two tokens.
    first = StaticDecode(**_kw(tok, do_sample=False)).generate(model, prompts, keys).completion_ids
    eos = sorted({c[1] for c in first if len(c) > 1})
    decode = StaticDecode(max_new_tokens=40, eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False,
                          check_every=2)
    got = decode.generate(model, prompts, keys)
    want = HFGenerate(max_new_tokens=40, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                      do_sample=False).generate(model, prompts, keys)
    assert got.completion_ids == want.completion_ids and got.truncated == want.truncated
    assert all(len(c) <= 2 for c in got.completion_ids) and not any(got.truncated)
    assert decode.last_call["steps"] <= 4  # every row done after 2 tokens, checked every 2


def test_processing_is_transformers_logits_processors():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 60, generator=g) * 3
    ids = torch.randint(0, 60, (4, 9), generator=g)
    want = z.clone()
    for p in (RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7), TopKLogitsWarper(25),
              TopPLogitsWarper(0.85), MinPLogitsWarper(0.03)):
        want = p(ids, want)
    seen = torch.zeros(4, 60, dtype=torch.bool).scatter_(1, ids, True)
    got = process_logits(z, seen, repetition_penalty=1.3, temperature=0.7, top_k=25, top_p=0.85, min_p=0.03)
    kept = torch.isfinite(want) & (want > torch.finfo(want.dtype).min)
    assert kept.any(1).all() and (~kept).any()
    assert torch.equal(got > torch.finfo(got.dtype).min, kept)
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1))


def test_draws_are_samples_of_the_softmax():
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, torch.finfo(torch.float32).min])
    torch.manual_seed(0)
    tokens = gumbel_max(z.expand(200_000, -1).contiguous())
    got = torch.bincount(tokens, minlength=6).double() / tokens.numel()
    want = z.double().softmax(-1)
    assert 0.5 * (got - want).abs().sum() < 0.005, (got, want)
    assert got[5] == 0


def test_sliding_window_models_fall_back_to_generate():
    model, tok = load_model("builtin:tiny-gemma2").eval(), load_tokenizer("builtin:tiny-gemma2")
    decode = StaticDecode(**_kw(tok, do_sample=False))
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    got = decode.generate(model, prompts, keys)
    assert decode.last_call == {"path": "generate", "why": "sliding-window layers"}
    assert got.completion_ids == HFGenerate(**_kw(tok, do_sample=False)).generate(model, prompts, keys).completion_ids


def test_generation_backend_flag(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path))
    assert args.generation_backend == "auto"
    assert args.resolved_generation_backend == ("static" if args.device.type == "cuda" else "generate")
    assert GRPOConfig(output_dir=str(tmp_path), generation_backend="static").resolved_generation_backend == "static"
    assert GRPOConfig(output_dir=str(tmp_path), cache_implementation="static").resolved_generation_backend == "generate"
    # --compile_generation compiles whichever backend decodes; it does not pick one.
    compiled = GRPOConfig(output_dir=str(tmp_path), compile_generation=True)
    assert compiled.resolved_generation_backend == args.resolved_generation_backend
    with pytest.raises(ValueError, match="generation_kwargs is an option of transformers' generate"):
        GRPOConfig(output_dir=str(tmp_path), generation_backend="static", generation_kwargs={"top_k": 3})
    with pytest.raises(ValueError, match="generation_backend"):
        GRPOConfig(output_dir=str(tmp_path), generation_backend="vllm")


@pytest.mark.cuda_path
def test_grpo_trains_the_same_on_either_generation_backend(tmp_path):
    """Keyed sampling gives the same completions on either backend, so two GRPO steps log the
    same values and end at the same weights; the static backend really ran."""
    from fusedalign.data import load_dataset_any
    from fusedalign.rewards import load_reward_function
    from fusedalign.trainers.grpo import GRPOTrainer

    prompts = load_dataset_any("builtin:zen", "standard_prompt_only").select(range(8))
    runs = {}
    for backend in ("generate", "static"):
        args = GRPOConfig(output_dir=str(tmp_path / backend), max_steps=2, learning_rate=0.05, optim="sgd",
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=10,
                          logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                          keyed_sampling=True, generation_backend=backend)
        torch.manual_seed(0)
        trainer = GRPOTrainer(load_model("builtin:tiny-qwen2"), reward_funcs=load_reward_function("zen_words"),
                              args=args, train_dataset=prompts)
        trainer.train()
        assert type(trainer.generator).__name__ == {"generate": "HFGenerate", "static": "StaticDecode"}[backend]
        logs = [{k: v for k, v in e.items() if "time" not in k and "runtime" not in k}
                for e in trainer.state.log_history if "loss" in e]
        runs[backend] = logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    # On CUDA bf16 is on over the float32 builtin model: both generators run under autocast, so the
    # same keyed draws give the same completions (what they depend on: rewards, lengths exactly),
    # while the losses of the two runs may part by bf16 rounding of different kernels.
    bf16 = args.bf16
    for got, want in zip(runs["static"][0], runs["generate"][0], strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            exact = key.startswith(("reward", "completions/")) or key in ("step", "epoch", "num_tokens")
            if bf16 and not exact:
                assert got[key] == pytest.approx(value, rel=2e-2, abs=2e-3), key
            else:
                assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    for name, value in runs["generate"][1].items():
        tolerance = dict(rtol=2e-2, atol=1e-3) if bf16 else dict(rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(runs["static"][1][name], value, **tolerance, msg=name)
    assert any(e["completions/mean_length"] > 1 for e in runs["static"][0])


# ------------------------------------------------------------------ CUDA


def _cuda_model(dtype=torch.float32):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, vocab_size=151936, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().eval()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("penalty,window,compiled", [(1.0, 256, False), (1.3, 256, False), (1.0, 16, False),
                                                     (1.3, 16, True)])
def test_cuda_graph_decoding_equals_eager_and_generate(penalty, window, compiled):
    """Greedy tokens from the graph replays equal the eager loop's and generate's; the graph is
    captured anew per call, so weights changed in place between calls are seen. With a window
    of 16 cache slots the graph is captured again as the tokens outgrow each window. Compiled:
    the same, from graphs captured of the inductor-compiled step."""
    tok = load_tokenizer("builtin:tiny-qwen2")
    model = _cuda_model()
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    kw = dict(max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False,
              repetition_penalty=penalty)
    graphed = StaticDecode(**kw, window_slots=window, compact_below=0, compile_step=compiled)
    eager = StaticDecode(**kw, cuda_graphs=False)
    before = graphed.generate(model, prompts, keys).completion_ids
    assert graphed.last_call["graph"] is True and graphed.last_call["compiled"] is compiled
    # 9-token prompts, 39 decoding steps writing slots 9 to 47: windows of 16, 32 and 48 slots
    assert graphed.last_call["graphs"] == (3 if window == 16 else 1), graphed.last_call
    assert before == eager.generate(model, prompts, keys).completion_ids
    assert before == HFGenerate(**kw).generate(model, prompts, keys).completion_ids
    with torch.no_grad():  # what an optimizer step does: new values in the same storage
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = graphed.generate(model, prompts, keys).completion_ids
    assert after == eager.generate(model, prompts, keys).completion_ids
    assert after != before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled,kernel,flags", [
    (False, "sdpa", dict(temperature=0.8, top_k=40, top_p=0.95)),
    (True, "sdpa", dict(temperature=0.8, top_k=40, top_p=0.95)),
    (False, "triton", dict(temperature=0.8, top_k=40, top_p=0.95)),  # the draw kernel on the processed scores
    (True, "triton", dict(temperature=0.8)),  # the draw kernel on the logits, inside the compiled step
])
def test_cuda_graph_sampling_draws_fresh_samples_of_the_processed_softmax(compiled, kernel, flags):
    """A head whose logits are the same vector b at every position, whatever the context: every
    token drawn by a graph replay follows the processed softmax of b, and the replays draw
    fresh noise (no row repeats one token all along). Compiled: inductor's random numbers,
    replayed in the graph, are fresh at every replay too. decode_kernel="triton": the draws
    are the Triton draw kernel's (`draw_kernel.py`), from the processed scores, or from the
    logits in the model's dtype when only the temperature is on."""
    tok = load_tokenizer("builtin:tiny-qwen2")
    model = _cuda_model()
    vocab = model.config.vocab_size
    b = torch.full((vocab,), -30.0, device="cuda")
    b[:64] = torch.randn(64, generator=torch.Generator().manual_seed(0)).cuda() * 2
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True, device="cuda")
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(b)
    model.lm_head = head
    decode = StaticDecode(max_new_tokens=24, eos_token_id=vocab - 1, pad_token_id=tok.pad_token_id,
                          compile_step=compiled, decode_kernel=kernel, **flags)
    torch.manual_seed(0)
    out = decode.generate(model, [_prompts()[1]] * 1024, _keys(1024))
    assert decode.last_call["graph"] is True and decode.last_call["steps"] == 24
    assert decode.last_call["compiled"] is compiled and decode.last_call["draw_kernel"] is (kernel == "triton")
    tokens = torch.tensor(out.completion_ids, device="cuda")[:, 2:]  # the replayed steps
    want = process_logits(b[None], None, **flags)[0].double().softmax(-1)
    got = torch.bincount(tokens.flatten(), minlength=vocab).double() / tokens.numel()
    assert 0.5 * (got - want).abs().sum() < 0.03
    assert got[want == 0].sum() == 0
    # Fresh noise each replay: a row repeats one token all along as often as independent draws
    # do (sum of p^22; the same noise every replay would make it every row).
    repeated = (tokens == tokens[:, :1]).all(1).double().mean()
    assert abs(repeated - (want ** tokens.shape[1]).sum()) < 0.04, (repeated, (want ** tokens.shape[1]).sum())


def test_keys_whose_dtype_changes_after_the_prefill_decode_as_generate(monkeypatch):
    """Under autocast a float32 model's keys can come in float32 from the prefill and in bfloat16
    from the decoding steps (seen on CUDA with bf16 on): the static cache keeps its first dtype,
    and the completions are generate's (whose dynamic cache concatenates and promotes)."""
    from transformers.models.qwen2 import modeling_qwen2

    rotate = modeling_qwen2.apply_rotary_pos_emb

    def bf16_keys_when_decoding(q, k, cos, sin, *args, **kwargs):
        q, k = rotate(q, k, cos, sin, *args, **kwargs)
        return q, k.to(torch.bfloat16) if k.shape[-2] == 1 else k

    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", bf16_keys_when_decoding)
    model, tok = load_model("builtin:tiny-qwen2", attn_implementation="eager").eval(), load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    want = HFGenerate(**_kw(tok, do_sample=False)).generate(model, prompts, keys)
    decode = StaticDecode(**_kw(tok, do_sample=False))
    got = decode.generate(model, prompts, keys)
    assert decode.last_call["path"] == "static"
    assert got.completion_ids == want.completion_ids and got.truncated == want.truncated


def test_a_float32_model_under_bf16_autocast_decodes_as_generate(monkeypatch):
    """What CUDA showed with transformers 5.17: under autocast the keys leave the rotary embedding in
    float32 and the values leave v_proj in bfloat16, and the static cache allocates both buffers in
    the keys' dtype (emulated here on a later transformers). The completions are generate's."""
    from transformers.cache_utils import StaticLayer

    initialize = StaticLayer.lazy_initialization

    def both_in_the_keys_dtype(self, key_states, value_states, *args, **kwargs):
        return initialize(self, key_states, value_states.to(key_states.dtype), *args, **kwargs)

    monkeypatch.setattr(StaticLayer, "lazy_initialization", both_in_the_keys_dtype)
    model, tok = load_model("builtin:tiny-qwen2", attn_implementation="eager").eval(), load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = HFGenerate(**_kw(tok, do_sample=False)).generate(model, prompts, keys)
        decode = StaticDecode(**_kw(tok, do_sample=False))
        got = decode.generate(model, prompts, keys)
    assert decode.last_call["path"] == "static"
    assert got.completion_ids == want.completion_ids and got.truncated == want.truncated


@pytest.mark.parametrize("window", [4, 5, 16, 0])
def test_graph_windows_cover_every_slot_a_step_attends_to(monkeypatch, window):
    """The loop's graph bookkeeping on the CPU: a stand-in for CUDA graphs replays the step with
    the window it was captured with, as a graph would. Had a window been too small for a step,
    the step would not see its last tokens and the greedy tokens would differ from generate's."""
    from tests.stand_in_graphs import stand_in_graphs

    captured = stand_in_graphs(monkeypatch)
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    tok = load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    kw = dict(max_new_tokens=14, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False)
    decode = StaticDecode(**kw, window_slots=window, compact_below=0)
    got = decode.generate(model, prompts, keys)
    assert got.completion_ids == HFGenerate(**kw).generate(model, prompts, keys).completion_ids
    # 9-token prompts, 13 decoding steps writing slots 9 to 21 of a 23-slot cache
    want = {4: [12, 16, 20, 23], 5: [10, 15, 20, 23], 16: [16, 23], 0: [23]}[window]
    assert captured == want and decode.last_call["graphs"] == len(want)


@pytest.mark.parametrize("flags", [
    dict(do_sample=False, repetition_penalty=1.3),
    dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2),
    dict(temperature=1.2, min_p=0.05),
    dict(temperature=0.9, fused_sampling=True, repetition_penalty=1.3),
], ids=["greedy_penalty", "top_k_top_p", "min_p", "fused_sampling"])
def test_a_captured_step_holds_to_what_capture_accepts_and_draws_as_the_eager_loop(monkeypatch, flags):
    """Every processor TRL's flags reach, and the fused sampling head, inside the stand-in graphs
    held to the capture's rules (tests/stand_in_graphs.py: no value read back to the host, no tensor
    made from host data): the same tokens as the eager loop from the same seed, through several
    windows and a compaction."""
    from tests.stand_in_graphs import eager_and_stand_in

    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    tok = load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    kw = dict(_kw(tok, **flags), window_slots=4, compact_below=0.9, check_every=2)
    torch.manual_seed(1)
    first = StaticDecode(**kw, cuda_graphs=False).generate(model, prompts, keys).completion_ids
    kw["eos_token_id"] = first[2][1]  # a token one row draws early: rows end unevenly, the batch compacts
    want, got, decode, captured = eager_and_stand_in(monkeypatch, model, prompts, keys, 1, **kw)
    assert decode.last_call["path"] == "static" and decode.last_call["graphs"] >= 2 and len(set(captured)) >= 2
    assert len(decode.last_call["batch_sizes"]) >= 2, decode.last_call
    assert got.completion_ids == want.completion_ids and got.truncated == want.truncated


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the trainer's generation captures real graphs")
def test_grpo_with_a_lora_policy_decodes_in_stand_in_graphs_as_in_the_eager_loop(monkeypatch, tmp_path):
    """GRPO's own generation (static backend, unkeyed sampling, LoRA on q, v and the head: PEFT's
    layers inside the decoding step) in stand-in graphs held to what a CUDA graph's capture accepts
    (tests/stand_in_graphs.py) trains exactly as with the eager loop from the same seed."""
    from peft import LoraConfig

    from fusedalign.data import load_dataset_any
    from fusedalign.rewards import load_reward_function
    from fusedalign.trainers.grpo import GRPOTrainer
    from tests.stand_in_graphs import stand_in_graphs

    prompts = load_dataset_any("builtin:zen", "standard_prompt_only").select(range(8))
    runs = {}
    for graphs in (False, True):
        captured = stand_in_graphs(monkeypatch) if graphs else None
        args = GRPOConfig(output_dir=str(tmp_path / str(graphs)), max_steps=2, learning_rate=0.05, optim="sgd",
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=10,
                          logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                          generation_backend="static", temperature=0.9, top_p=0.95)
        lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                          target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
        torch.manual_seed(0)
        trainer = GRPOTrainer(load_model("builtin:tiny-qwen2"), reward_funcs=load_reward_function("zen_words"),
                              args=args, train_dataset=prompts, peft_config=lora)
        trainer.train()
        assert trainer.generator.last_call["path"] == "static"
        assert trainer.generator.last_call["graph"] is graphs and (not graphs or captured)
        logs = [{k: v for k, v in e.items() if "time" not in k and "runtime" not in k}
                for e in trainer.state.log_history if "loss" in e]
        runs[graphs] = logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        monkeypatch.undo()
    assert runs[True][0] == runs[False][0]
    assert any(e["completions/mean_length"] > 1 for e in runs[True][0])
    for name, value in runs[False][1].items():
        assert torch.equal(runs[True][1][name], value), name


def test_every_capture_warms_up_on_one_stream_a_device(monkeypatch):
    """cuBLAS keeps a workspace for every stream it ran a GEMM on, never freed: a new stream per
    capture left one behind each capture. The warm-up stream is made once per device."""
    from fusedalign.generation import decode_state

    made = []
    monkeypatch.setattr(decode_state, "_WARMUP_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    first = decode_state.warmup_stream(torch.device("cuda", 0))
    assert decode_state.warmup_stream("cuda:0") is first and decode_state.warmup_stream("cuda") is first
    other = decode_state.warmup_stream(torch.device("cuda", 1))
    assert other is not first and made == [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_repeated_graphed_generations_leave_no_memory_behind():
    """Generations that capture their step (three windows a call here) hold the same memory from
    the second call on: before every capture warmed up on one stream, each
    capture left a cuBLAS workspace behind (GRPO's memory at rest grew 64.5 MiB between steps at
    f7eace9 on an H100, two captures a generation)."""
    tok = load_tokenizer("builtin:tiny-qwen2")
    model = _cuda_model()
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    decode = StaticDecode(max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          do_sample=False, window_slots=16, compact_below=0)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # every stream without a workspace, whatever ran before
    held = []
    for _ in range(4):
        out = decode.generate(model, prompts, keys)
        assert decode.last_call["graphs"] == 3, decode.last_call
        del out
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert held[2] == held[1] and held[3] == held[1], [h - held[0] for h in held]  # a new stream a capture: +3 each
