"""Knowledge distillation: a student learns a teacher's next-token distributions.

The teacher (the `[distill]` table's model folder) runs forward without gradients on every
batch, and its log-probabilities, softened by the temperature, ride along in the batch as
"teacher_logps" [B, T, vocab]; `distill_loss` (losses.py) compares the student's to them at
every position that has a label. A draft model for speculative decoding is the use in mind:
what decides its worth is how often its greedy token is the teacher's, which the loss reports
as `teacher_agreement`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from astrai.config import ConfigError, DistillConfig, ModelConfig, TrainConfig
from astrai.model import forward, load_pretrained, model_config_from_json


def teacher_config(distill: DistillConfig) -> ModelConfig:
    """The teacher's config.json; a ConfigError naming distill.teacher when it is no model."""
    folder = Path(distill.teacher)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"distill.teacher: {folder} is not a model folder (no config.json)")
    return model_config_from_json(folder / "config.json")


def check_teacher(teacher: ModelConfig, student: ModelConfig, distill: DistillConfig) -> None:
    """The student reads the teacher's tokens: the two vocabularies must be one."""
    if teacher.vocab_size != student.vocab_size:
        raise ConfigError(
            f"distill.teacher: {distill.teacher} has a vocabulary of {teacher.vocab_size} tokens,"
            f" the student's has {student.vocab_size}; a student must share its teacher's"
            " tokenizer"
        )
    if teacher.model_type != "decoder":
        raise ConfigError(f"distill.teacher: {distill.teacher} is not a decoder")


def check_distill(cfg: TrainConfig) -> None:
    """A teacher folder that is missing, or whose vocabulary is not the student's, fails when
    the run starts, before the data is opened (an init_from student is checked once loaded)."""
    if cfg.distill.teacher:
        teacher = teacher_config(cfg.distill)
        if cfg.model is not None:
            check_teacher(teacher, cfg.model, cfg.distill)


def load_teacher(distill: DistillConfig, student: ModelConfig, device) -> tuple[dict, ModelConfig]:
    """The teacher's weights and config, checked against the student."""
    check_teacher(teacher_config(distill), student, distill)
    params, cfg = load_pretrained(distill.teacher, device=device)
    return params, cfg


@torch.no_grad()
def with_teacher_logps(batch: dict, teacher: tuple[dict, ModelConfig], temperature: float):
    """The batch with the teacher's log-probabilities at temperature, "teacher_logps"."""
    params, cfg = teacher
    logits = forward(
        params,
        cfg,
        batch["input_ids"],
        positions=batch.get("positions"),
        doc_ids=batch.get("doc_ids"),
    ).float()
    return {**batch, "teacher_logps": torch.log_softmax(logits / temperature, dim=-1)}
