"""The DPO step's command line: the supervised step's flags plus the `--dpo_*` group."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from training.algorithms import PREFERENCE_LOSSES, PreferenceLoss, get_preference_loss
from training.core.args import check_positive
from training.loops.supervised_step import PreferenceSettings
from utils.errors import UserError, refuse_all


@dataclass
class DPOArguments:
    """The preference objective and its frozen reference (the step-1 model the run starts from)."""

    beta: float = field(default=0.1, metadata={
        "flag": "dpo_beta",
        "help": "strength of the tie to the reference: the implicit reward is beta * (policy - reference) "
                "log-prob; larger keeps the policy closer to the reference"})
    loss: str = field(default="sigmoid", metadata={
        "flag": "dpo_loss",
        "help": f"preference loss, one of: {', '.join(PREFERENCE_LOSSES.names())} "
                "(sigmoid: DPO, ipo: IPO on per-token mean log-probs, hinge: SLiC/RSO)"})
    label_smoothing: float = field(default=0.0, metadata={
        "flag": "dpo_label_smoothing",
        "help": "assumed share of pairs whose preference label is wrong (conservative DPO), in [0, 0.5); "
                "sigmoid loss only"})
    offload_reference_model: bool = field(default=False, metadata={
        "help": "keep the reference model's weights in CPU memory (ZeRO-3 parameter offload)"})

    def preference_loss(self) -> PreferenceLoss:
        """The registered loss these settings select, after checking them (a `UserError` says what to change)."""
        refuse_all(partial(get_preference_loss, self.loss), partial(check_positive, {"dpo_beta": self.beta}, "dpo_beta"),
                   self._check_label_smoothing_range)
        # the check below builds on a loss those above found
        loss = get_preference_loss(self.loss)
        if self.label_smoothing and loss.name != "sigmoid":
            raise UserError(f"--dpo_label_smoothing applies to --dpo_loss sigmoid only, not {loss.name!r}; "
                            "drop it or use the sigmoid loss")
        return loss

    def _check_label_smoothing_range(self) -> None:
        if not 0.0 <= self.label_smoothing < 0.5:
            raise UserError(f"--dpo_label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


@dataclass
class DPOSettings(PreferenceSettings):
    """The command line of the DPO step."""

    dpo: DPOArguments

    def flag_checks(self) -> list[Callable[[], object]]:
        """The supervised step's checks, and the preference objective's (`DPOArguments.preference_loss`)."""
        return [*super().flag_checks(), self.dpo.preference_loss]
