"""SFTTrainer on tiny models: fused == unfused, packed == padded == alone, invariants, LoRA, merge, errors."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from datasets import Dataset

from fusedalign import cli
from fusedalign.attention import PackedAttentionError
from fusedalign.configs import SFTConfig
from fusedalign.data import DataError, SFTCollator, load_dataset_any
from fusedalign.head import IGNORE_INDEX, logprobs_from_logits, token_logprobs
from fusedalign.models import load_model
from fusedalign.trainers.sft import SFTTrainer

LM = "standard_language_modeling"


def _data(config: str = LM, rows: int | None = None) -> Dataset:
    data = load_dataset_any("builtin:zen", config, split="train")
    return data.select(range(rows)) if rows else data


def _args(tmp_path, **kw) -> SFTConfig:
    values = dict(
        output_dir=str(tmp_path / "out"), max_steps=3, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=4,
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", seed=0, data_seed=0,
        report_to="none", disable_tqdm=True, max_length=64, dataloader_drop_last=True,
    )
    values.update(kw)
    return SFTConfig(**values)


def _trainer(tmp_path, data=None, model="builtin:tiny-qwen2", peft_config=None, **kw) -> SFTTrainer:
    torch.manual_seed(0)
    if isinstance(model, str):
        model = load_model(model)
    return SFTTrainer(model, args=_args(tmp_path, **kw), train_dataset=data if data is not None else _data(),
                      peft_config=peft_config)


def _train(tmp_path, **kw) -> tuple[list[float], dict[str, torch.Tensor], SFTTrainer]:
    trainer = _trainer(tmp_path, **kw)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return losses, weights, trainer


def _assert_same_run(a, b, rtol=1e-5, atol=1e-6):
    losses_a, weights_a = a[:2]
    losses_b, weights_b = b[:2]
    torch.testing.assert_close(torch.tensor(losses_b), torch.tensor(losses_a), rtol=rtol, atol=0)
    assert weights_a.keys() == weights_b.keys()
    for name, value in weights_a.items():
        torch.testing.assert_close(weights_b[name], value, rtol=rtol, atol=atol, msg=name)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize(
    "config, layout",
    [("standard_prompt_completion", {}), (LM, {"packing": True}), ("conversational_prompt_completion", {"padding_free": True})],
    ids=["padded", "packed", "padding_free"],
)
def test_fused_equals_unfused_losses_and_weights(tmp_path, config, layout):
    fused = _train(tmp_path, data=_data(config), fused_head=True, **layout)
    unfused = _train(tmp_path, data=_data(config), fused_head=False, **layout)
    assert len(fused[0]) == 3 and fused[0][-1] < fused[0][0]
    _assert_same_run(unfused, fused)
    start = load_model("builtin:tiny-qwen2").state_dict()
    assert not torch.equal(fused[1]["lm_head.weight"], start["lm_head.weight"])  # it did train


def test_packed_and_padding_free_equal_padded_on_the_same_examples(tmp_path):
    data = _data(rows=12)
    # One step over all 12 rows: the same examples and the same global token count.
    padded = _train(tmp_path, data=data, per_device_train_batch_size=12, max_steps=1)
    packed_rows = len(_trainer(tmp_path, data=data, packing=True).train_dataset)
    assert packed_rows < 12  # several sequences per packed row
    packed = _train(tmp_path, data=data, packing=True, per_device_train_batch_size=packed_rows, max_steps=1)
    _assert_same_run(padded, packed)
    # Padding-free without packing keeps the batches themselves: equal at every step.
    _assert_same_run(_train(tmp_path, data=data), _train(tmp_path, data=data, padding_free=True))


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    data = _data("standard_prompt_completion")  # rows of unequal lengths and label counts
    big = _train(tmp_path, data=data, per_device_train_batch_size=8)
    accumulated = _train(tmp_path, data=data, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    _assert_same_run(big, accumulated)


# ------------------------------------------------------------------ no cross-attention


def _sequence_logps(trainer, batch, fused=True):
    labels = trainer.labels(batch)
    return token_logprobs(trainer.model, trainer.model_inputs(batch), targets=labels, fused=fused).logps, labels


@pytest.mark.parametrize(
    "name, attn",
    [("builtin:tiny-qwen2", "sdpa"), ("builtin:tiny-qwen2", "eager"), ("builtin:tiny-llama", "sdpa"),
     ("builtin:tiny-llama", "eager"), ("builtin:tiny-gemma2", "eager")],  # transformers has no sdpa for Gemma 2
)
def test_packed_batch_equals_each_sequence_alone(tmp_path, name, attn):
    model = load_model(name, attn_implementation=attn)
    trainer = _trainer(tmp_path, data=_data(rows=16), model=model, packing=True, max_length=48)
    row = trainer.train_dataset[0]
    assert len(row["seq_lengths"]) >= 3
    batch = trainer.data_collator([row])
    assert "attention_mask" not in batch
    with torch.no_grad():
        packed, labels = _sequence_logps(trainer, batch)
        start = 0
        for length in row["seq_lengths"]:
            alone_batch = SFTCollator(pad_token_id=0)([{k: row[k][start:start + length] for k in ("input_ids", "completion_mask")}])
            alone, alone_labels = _sequence_logps(trainer, alone_batch)
            assert torch.equal(labels[:, start:start + length], alone_labels)
            torch.testing.assert_close(packed[:, start:start + length], alone, rtol=1e-5, atol=1e-5)
            start += length
        # The control: one long causal sequence (positions never restart) scores differently,
        # so the comparison above would see any attention across the boundaries.
        leaky = dict(batch, position_ids=torch.arange(batch["input_ids"].shape[1])[None])
        leaky_logps = token_logprobs(trainer.model, trainer.model_inputs(leaky), targets=labels).logps
    assert not torch.allclose(leaky_logps, packed, atol=1e-3)


def test_attention_without_a_mask_builder_is_refused(tmp_path):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("unmasked_sdpa_test", sdpa_attention_forward)
    model = load_model("builtin:tiny-qwen2", attn_implementation="unmasked_sdpa_test")
    for layout in ({"packing": True}, {"padding_free": True}):
        with pytest.raises(PackedAttentionError, match="unmasked_sdpa_test"):
            _trainer(tmp_path, model=model, **layout)
    _trainer(tmp_path, model=model)  # padded batches carry their own mask: fine


# ------------------------------------------------------------------------ metrics


def test_metrics_equal_the_unfused_computation_and_num_tokens_counts_inputs(tmp_path):
    trainer = _trainer(tmp_path, data=_data("standard_prompt_completion"), max_steps=2)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        _, metrics = trainer.loss_and_metrics(trainer.model, batch, "eval")
        labels = trainer.labels(batch)
        logits = trainer.model(**trainer.model_inputs(batch)).logits  # [B, T, V]
    mask = labels != IGNORE_INDEX
    correct, count = metrics.accuracy.sum, metrics.accuracy.count  # per row
    assert correct.shape == count.shape == (labels.shape[0],)
    assert int(count.sum()) == int(mask.sum()) == trainer.count_items(batch)
    assert int(correct.sum()) == int((logits.argmax(-1) == labels)[mask].sum())
    entropy = logprobs_from_logits(logits, labels, entropy=True).entropy
    torch.testing.assert_close(float(metrics.entropy.sum.sum()), float(entropy[mask].sum()), rtol=1e-5, atol=1e-5)

    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    inputs = [b["attention_mask"].sum().item() for b, _ in zip(trainer.get_train_dataloader(), range(2))]
    assert [h["num_tokens"] for h in logged] == [inputs[0], inputs[0] + inputs[1]]  # cumulative, as TRL
    assert all(0.0 <= h["mean_token_accuracy"] <= 1.0 and h["entropy"] > 0 for h in logged)


# ---------------------------------------------------------------------- LoRA, merge


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj", "lm_head"], **kw)


def test_lora_on_attention_and_head_trains_fused_equal_unfused_and_merges(tmp_path):
    fused = _train(tmp_path, peft_config=_lora(), fused_head=True)
    unfused = _train(tmp_path, peft_config=_lora(), fused_head=False)
    _assert_same_run(unfused, fused)
    trainer = fused[2]
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    head_b = [n for n in trainable if "lm_head" in n and "lora_B" in n]
    assert head_b and fused[1][head_b[0]].abs().max() > 0  # B starts at zero: the head adapter trained
    start = load_model("builtin:tiny-qwen2").state_dict()
    base_head = next(n for n in fused[1] if n.endswith("lm_head.base_layer.weight"))
    assert torch.equal(fused[1][base_head], start["lm_head.weight"])  # the base stays frozen

    adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
    trainer.save_model(adapter_dir)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(adapter_dir))
    assert cli.main(["merge", adapter_dir, merged_dir]) == 0
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(merged_dir))
    merged = load_model(merged_dir)
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 33]])
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_merge_refuses_a_directory_that_is_not_an_adapter(tmp_path, capsys):
    assert cli.main(["merge", str(tmp_path), str(tmp_path / "x")]) == 2
    assert "not a PEFT adapter directory" in capsys.readouterr().err
    assert cli.main(["merge", str(tmp_path)]) == 2


def test_merge_writes_into_a_new_directory_only_and_takes_output_dir(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    assert cli.main(["sft", "--use_peft", "--max_steps", "1", "--eval_strategy", "no", "--output_dir", str(adapter)]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in adapter.iterdir()}
    capsys.readouterr()
    # Into the adapter's own directory (or any that holds files): refused in one line, nothing written.
    assert cli.main(["merge", str(adapter), str(adapter)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"OUTPUT_DIR {adapter} already holds files (README.md, adapter_config.json" in err, err
    assert {p.name: p.stat().st_mtime_ns for p in adapter.iterdir()} == before
    # A training command's --output_dir names OUTPUT_DIR too.
    assert cli.main(["merge", str(adapter), "--output_dir", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["merge", str(adapter), str(empty)]) == 0


# --------------------------------------------------------------------------- errors


def test_overlong_rows_are_truncated_counted_and_kept(tmp_path, caplog):
    data = _data(rows=8)
    with caplog.at_level(logging.WARNING):
        trainer = _trainer(tmp_path, data=data, max_length=6)
    assert len(trainer.train_dataset) == 8
    assert max(len(r) for r in trainer.train_dataset["input_ids"]) == 6
    assert any("8 of 8 rows were truncated" in r.getMessage() for r in caplog.records)


def test_nothing_to_learn_is_an_error_before_training(tmp_path):
    # keep_start at 3 tokens keeps only (part of) each prompt.
    with pytest.raises(DataError, match="none of its .* rows has a token to learn from"):
        _trainer(tmp_path, data=_data("standard_prompt_completion", rows=6), max_length=3)
    with pytest.raises(DataError, match="empty"):
        _trainer(tmp_path, data=_data().select([]))


def test_bad_data_and_options_fail_before_training(tmp_path):
    with pytest.raises(DataError):
        _trainer(tmp_path, data=_data("standard_preference", rows=4))  # preference data for SFT
    with pytest.raises(DataError, match="assistant_only_loss"):
        _trainer(tmp_path, data=_data(rows=4), assistant_only_loss=True)
    with pytest.raises(ValueError, match="packing needs max_length"):
        _args(tmp_path, packing=True, max_length=None)
    with pytest.raises(ValueError, match="truncation_mode"):
        _args(tmp_path, truncation_mode="middle")
