"""Builtin models and tokenizer: real from_pretrained loads, architecture facts, chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from fusedalign.models import (
    MODELS_DIR,
    TOKENIZER_DIR,
    ModelNotFoundError,
    list_builtin_models,
    load_model,
    load_tokenizer,
    resolve_model_path,
)

REPO = Path(__file__).resolve().parents[2]
FAMILIES = {"tiny-qwen2": "qwen2", "tiny-llama": "llama", "tiny-gemma2": "gemma2", "tiny-zen-teacher": "llama"}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:tokenizer")


def test_list_builtin_models():
    assert list_builtin_models() == sorted(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_builtin_model_loads_and_runs(name, tokenizer):
    model = load_model(f"builtin:{name}")
    assert model.config.model_type == FAMILIES[name]
    assert model.dtype == torch.float32
    assert model.config.vocab_size >= len(tokenizer) and model.config.vocab_size % 8 == 0
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    # A real load: the weights are the stored ones, not a fresh init.
    stored = load_file(str(MODELS_DIR / name / "model.safetensors"))
    params = dict(model.named_parameters())
    for key, value in stored.items():
        assert torch.equal(params[key].detach(), value), key
    assert (MODELS_DIR / name / "model.safetensors").stat().st_size < 1_000_000

    ids = torch.tensor([tokenizer("Beautiful is better than ugly.")["input_ids"]])
    out = model(input_ids=ids)
    assert out.logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(out.logits).all()
    # The model directory holds the tokenizer too.
    assert len(load_tokenizer(f"builtin:{name}")) == len(tokenizer)


def test_head_tying():
    qwen = load_model("builtin:tiny-qwen2")
    assert not qwen.config.tie_word_embeddings
    assert qwen.lm_head.weight.data_ptr() != qwen.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(qwen.lm_head.weight, qwen.model.embed_tokens.weight)
    llama = load_model("builtin:tiny-llama")
    assert llama.config.tie_word_embeddings
    assert llama.lm_head.weight is llama.model.embed_tokens.weight


def test_gemma2_softcap_applied():
    model = load_model("builtin:tiny-gemma2")
    assert model.config.final_logit_softcapping == 30.0
    assert model.config._attn_implementation == "eager"
    ids = torch.tensor([[5, 17, 99, 3]])
    out = model(input_ids=ids, output_hidden_states=True)
    raw = model.lm_head(out.hidden_states[-1])
    torch.testing.assert_close(out.logits, 30.0 * torch.tanh(raw / 30.0))


def test_resolve_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="tiny-qwen2") as e:
        resolve_model_path("builtin:tiny-gpt")
    assert isinstance(e.value, ValueError) and "builtin:tiny-gpt" in str(e.value)
    with pytest.raises(FileNotFoundError, match="./no/such/model"):
        load_model("./no/such/model")
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    # Hub-shaped, but its first component is a local directory: meant as a path.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ModelNotFoundError, match="'runs/sft' does not exist"):
        resolve_model_path("runs/sft")
    assert resolve_model_path("builtin:tiny-llama") == str(MODELS_DIR / "tiny-llama")


def test_tokenizer_offline_and_special_tokens(monkeypatch, tokenizer):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    assert 512 <= len(tok) <= 1024
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    for special in ("<|im_start|>", "<|im_end|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    text = "Errors should never pass silently."
    assert tok.decode(tok(text)["input_ids"]) == text


def test_chat_template_generation_prompt_and_assistant_mask(tokenizer):
    chat = [
        {"role": "user", "content": "Beautiful is"},
        {"role": "assistant", "content": "better than ugly."},
        {"role": "user", "content": "Now is"},
        {"role": "assistant", "content": "better than never."},
    ]
    prompt = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nBeautiful is<|im_end|>\n<|im_start|>assistant\n"
    full = tokenizer.apply_chat_template(chat, tokenize=False)
    assert full.startswith(prompt)
    out = tokenizer.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    assistant = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert assistant == "better than ugly.<|im_end|>better than never.<|im_end|>"


# The teacher is trained (float32, a few hundred optimizer steps), and CPUs of other instruction
# sets (AVX2, AVX-512, AMX) sum its matmuls in other orders: rebuilt on another CPU, its weights
# differ by rounding that training amplifies, seen up to 3.5e-3 of a tensor's norm (an AVX-512/AMX
# Xeon against the machine that built it) for a matrix and 9e-5 for a norm's weight vector.
# tiny-llama (its shape, another seed, untrained) differs from it by a matrix's whole norm and by
# at least 1.5e-2 in a norm's weights.
TEACHER_RTOL = {2: 2e-2, 1: 2e-3}  # by the tensor's number of dimensions


@pytest.mark.slow
def test_build_script_is_deterministic(tmp_path):
    """Rebuilding the resources gives the committed datasets, tokenizer and weights: bit for bit
    for the initialised models, within TEACHER_RTOL of each tensor's norm for the trained teacher."""
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_resources.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    resources = MODELS_DIR.parent
    for path in sorted((resources / "datasets").rglob("*.jsonl")):
        assert (tmp_path / path.relative_to(resources)).read_text() == path.read_text(), path
    built = json.loads((tmp_path / "tokenizer" / "tokenizer.json").read_text())
    assert built == json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    for name in FAMILIES:
        new = load_file(str(tmp_path / "models" / name / "model.safetensors"))
        old = load_file(str(MODELS_DIR / name / "model.safetensors"))
        assert new.keys() == old.keys(), name
        for key in new:
            if name == "tiny-zen-teacher":
                drift = (new[key] - old[key]).norm() / old[key].norm()
                assert drift < TEACHER_RTOL[old[key].dim()], (name, key, float(drift))
            else:
                assert torch.equal(new[key], old[key]), (name, key)


# ------------------------------------------------------------- hub names offline (issue 19, item 8)


@pytest.fixture
def no_hub_calls(monkeypatch):
    """Resets the once-per-process hub probe and fails the test if transformers is asked to download."""
    import transformers

    from fusedalign import hub

    monkeypatch.setattr(hub, "_probe", False)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained reached: the hub check let an unreachable name through")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    return monkeypatch


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
@pytest.mark.parametrize("name,builtin", [("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", "builtin:tiny-qwen2"),
                                          ("trl-internal-testing/tiny-LlamaForCausalLM-3.2", "builtin:tiny-llama")])
def test_hub_model_without_a_hub_fails_at_once_naming_the_builtin(no_hub_calls, env, name, builtin):
    from fusedalign.hub import HubUnreachableError

    for key, value in env.items():
        no_hub_calls.setenv(key, value)
    with pytest.raises(HubUnreachableError, match=f"'{name}' is a hub name, but the Hugging Face hub is not "
                                                   f"reachable .*use its builtin equivalent {builtin}"):
        load_model(name)
    with pytest.raises(HubUnreachableError, match=builtin):
        load_tokenizer(name)


def test_hub_dataset_without_a_hub_is_one_line_through_the_cli(tmp_path, no_hub_calls, capsys):
    from fusedalign.cli import main

    no_hub_calls.setenv("HF_HUB_OFFLINE", "1")
    assert main(["dpo", "--dataset_name", "trl-internal-testing/zen", "--dataset_config", "standard_preference",
                 "--output_dir", str(tmp_path / "o")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "HF_HUB_OFFLINE=1" in errors[0] and "builtin equivalent builtin:zen" in errors[0]
