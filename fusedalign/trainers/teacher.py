"""The distillation teacher: loaded like a reference model, frozen, and checked against the student.

The divergence compares the two models' next-token distributions token id by token id, so
they must share a tokenizer. A teacher whose head has more rows than the student's (a
vocabulary padded to a multiple of 64 or 128, say) is accepted: the op gives the student's
missing columns probability 0 (-inf logits), never a logit of 0. That makes the forward KL
(beta 0) infinite as soon as the teacher puts mass there, so that combination is refused,
as is a teacher with fewer rows (the student's extra tokens would have no teacher probability).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fusedalign.models import load_model_with, load_tokenizer
from fusedalign.trainers.policy import Policy, layer_options, model_dtype


def load_teacher(teacher: nn.Module | str | None, policy: Policy, args: Any) -> nn.Module:
    """The teacher (a model, a name/path, or `args.teacher_model_name_or_path`), checked against the student.

    Runs before the Trainer exists (under ZeRO-3 the arguments make `from_pretrained` load it
    partitioned); `fusedalign.distributed.prepare_reference_model` freezes it for the backend after.

    Raises:
        ValueError: no teacher given, another tokenizer, or vocabularies that cannot be compared.
    """
    name = teacher if isinstance(teacher, str) else args.teacher_model_name_or_path if teacher is None else None
    if teacher is None and name is None:
        raise ValueError("distillation needs a teacher: --teacher_model_name_or_path (builtin:<name>, a local path or "
                         "a hub id), or DistillationTrainer(teacher_model=...).")
    if name is not None:
        kwargs = dict(args.teacher_model_init_kwargs or {})
        if args.teacher_model_revision is not None:
            kwargs["revision"] = args.teacher_model_revision
        dtype = kwargs.pop("dtype", None) or model_dtype(args) or getattr(policy.model, "dtype", None)
        teacher = load_model_with(name, "teacher_model_init_kwargs", kwargs, dtype=dtype)
    path = name or getattr(getattr(teacher, "config", None), "_name_or_path", None)
    check_same_vocabulary(policy.model, policy.tokenizer, teacher, _tokenizer_at(path), args.beta, path)
    layer_options(teacher, args)
    return teacher


def check_same_vocabulary(student: nn.Module, tokenizer: Any, teacher: nn.Module, teacher_tokenizer: Any,
                          beta: float, teacher_name: str | None = None) -> None:
    """Refuses a teacher the divergence cannot be computed against; see the module docstring.

    Args:
        teacher_tokenizer: the tokenizer stored with the teacher, or None when it has none
            (then only the head sizes are compared).
    """
    who = f"the teacher {teacher_name}" if teacher_name else "the teacher"
    if teacher_tokenizer is not None and teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        differ = len(set(teacher_tokenizer.get_vocab().items()) ^ set(tokenizer.get_vocab().items()))
        raise ValueError(f"{who} uses another tokenizer than the student ({len(teacher_tokenizer)} tokens against "
                         f"{len(tokenizer)}, {differ} (token, id) pairs in one only); distillation compares the two "
                         "models' distributions token id by token id, so both must share one tokenizer.")
    vs, vt = _head_rows(student), _head_rows(teacher)
    if vt < vs:
        raise ValueError(f"{who}'s vocabulary ({vt} rows) is smaller than the student's ({vs}): the student's extra "
                         "tokens would have no teacher probability; use a teacher with at least the student's rows.")
    if vt > vs and beta == 0.0:
        raise ValueError(f"{who}'s vocabulary ({vt} rows) is larger than the student's ({vs}) and beta is 0 (forward "
                         "KL): the teacher's mass on the extra rows, which the student cannot give, makes it "
                         "infinite; use beta > 0, or a teacher whose head has the student's rows.")


def _head_rows(model: nn.Module) -> int:
    """Rows of the output head, from the config (a ZeRO-3 partitioned weight has no shape to read)."""
    config = model.config
    return int((config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size)


def _tokenizer_at(path: str | None) -> Any:
    if not path:
        return None
    try:
        return load_tokenizer(path)
    except (OSError, ValueError):  # a directory of weights alone: nothing to compare but the head sizes
        return None
