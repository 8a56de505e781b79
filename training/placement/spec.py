"""Where step 3's models live: a share of the ranks per model (FlexRLHF's placement ratio) turned into rank lists.

Roles: `actor`, `critic`, `reference`, `reward` and `rollout` (the generator). A rollout share of 0 means the
actor generates its own answers (the hybrid engine, as in DeepSpeed-Chat); a positive one puts a *shadow actor*
on the last `rollout * world` ranks, which generates while the others score and train, and receives the actor's
weights after every PPO step (disaggregation).

Layout rule, applied on the ranks left to the models (all of them, or those before the rollout ranks):
- a share is a fraction of the whole world; `share * world` must be a whole number of ranks, at least one;
- a model whose ranks are all those available spans them and runs one call after another with the others (the
  co-located way);
- the two models of a pair that can run at the same time -- (actor, critic) training, (reference, reward)
  scoring -- with smaller shares sit side by side on disjoint ranks, the first of the pair from the first
  rank: interleaving. Their shares may not add up to more than the ranks available.

The unit of work is a *chunk*: the prompt batch one rank reads from its data shard (exactly what it would
generate and train on alone). A model on n of W ranks serves the chunks of W/n ranks: member i serves chunks
i*W/n .. (i+1)*W/n - 1, so every chunk sees the same shapes, rows and order as in the co-located run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from utils.errors import UserError

ROLES = ("actor", "critic", "reference", "reward", "rollout")
MODEL_ROLES = ROLES[:4]
CONCURRENT_PAIRS = (("actor", "critic"), ("reference", "reward"))

PRESETS: dict[str, dict[str, float]] = {
    "colocate": {"actor": 1.0, "critic": 1.0, "reference": 1.0, "reward": 1.0, "rollout": 0.0},
    # FlexRLHF's Interleave1: the two frozen models score on the two halves at the same time
    "interleave": {"actor": 1.0, "critic": 1.0, "reference": 0.5, "reward": 0.5, "rollout": 0.0},
    # generation on its own half, on a shadow actor; everything else co-located on the other half
    "disaggregate": {"actor": 0.5, "critic": 0.5, "reference": 0.5, "reward": 0.5, "rollout": 0.5},
}
AUTO = "auto"
PLACEMENTS = (*PRESETS, AUTO)


class ShareList(dict):
    """Shares read from FlexRLHF's positional list (`[1, 1, 0.5, 0.5]`): a position cannot be left out, so a
    refusal of one names the value to put there instead."""


def parse_placement_ratio(text: str) -> dict[str, float]:
    """`actor=1,critic=1,reference=0.5,reward=0.5[,rollout=0]` or FlexRLHF's list `[1, 1, 0.5, 0.5]` (roles in
    the order actor, critic, reference, reward, rollout); roles left out keep the placement's share. Strict:
    commas between items, whitespace around them allowed; an empty item, a role named twice, named and positional
    items mixed or an unbalanced bracket is one `UserError`. A list's shares come as a `ShareList`."""
    items = [item.strip() for item in _unbracketed(text).split(",")]
    if items == [""]:
        raise UserError(f"--placement_ratio {text!r} names no share; e.g. 'reference=0.5,reward=0.5' or '[1,1,0.5,0.5]'")
    if "" in items:
        raise UserError(f"--placement_ratio {text!r} has an empty item; separate the shares by single commas")
    named = ["=" in item for item in items]
    if any(named) and not all(named):
        raise UserError(f"--placement_ratio {text!r} mixes named shares (role=share) and a list of shares; use one "
                        "form")
    if not any(named) and len(items) > len(ROLES):
        raise UserError(f"--placement_ratio {text!r} lists {len(items)} shares; at most {len(ROLES)} ({', '.join(ROLES)})")
    pairs = [_role_and_value(text, item) for item in items] if all(named) else list(zip(ROLES, items))
    shares: dict[str, float] = {}
    for role, value in pairs:
        if role in shares:
            raise UserError(f"--placement_ratio {text!r} gives the share of the {role} twice; give it once")
        shares[role] = _share_value(text, role, value)
    return shares if all(named) else ShareList(shares)


BRACKETS = {"[": "]", "(": ")"}


def _unbracketed(text: str) -> str:
    """`text` without the one pair of brackets that may enclose it; any other bracket is refused."""
    body = text.strip()
    if body[:1] in BRACKETS and body[-1:] == BRACKETS[body[0]] and len(body) > 1:
        body = body[1:-1]
    if any(bracket in body for pair in BRACKETS.items() for bracket in pair):
        raise UserError(f"--placement_ratio {text!r} has an unbalanced or misplaced bracket; enclose the whole list "
                        "in one pair, e.g. '[1,1,0.5,0.5]', or use none")
    return body


def _role_and_value(text: str, item: str) -> tuple[str, str]:
    role, _, value = (part.strip() for part in item.partition("="))
    if role not in ROLES:
        raise UserError(f"--placement_ratio {text!r}: unknown model {role!r}; the models are {', '.join(ROLES)}")
    return role, value


def _share_value(text: str, role: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UserError(f"--placement_ratio {text!r}: the share of the {role} is not a number: {value!r}") from None


@dataclass(frozen=True)
class Placement:
    """Each present role's ranks (sorted); `rollout` only when generation has ranks of its own."""

    name: str
    world_size: int
    ranks: Mapping[str, tuple[int, ...]]

    @property
    def generation_role(self) -> str:
        return "rollout" if "rollout" in self.ranks else "actor"

    @property
    def is_colocated(self) -> bool:
        every = tuple(range(self.world_size))
        return all(ranks == every for ranks in self.ranks.values())

    def has(self, role: str) -> bool:
        return role in self.ranks

    def holds(self, role: str, rank: int) -> bool:
        return rank in self.ranks.get(role, ())

    def owner(self, role: str, chunk: int) -> int:
        """The rank that runs `role`'s calls on `chunk` (one rank's prompt batch)."""
        members = self.ranks[role]
        return members[chunk * len(members) // self.world_size]

    def chunks(self, role: str, rank: int) -> list[int]:
        """The chunks `rank` serves for `role` (none if it does not hold the model), in order."""
        if role not in self.ranks:
            return []
        return [chunk for chunk in range(self.world_size) if self.owner(role, chunk) == rank]

    def chunks_per_member(self, role: str) -> int:
        return self.world_size // len(self.ranks[role])

    def concurrent(self, first: str, second: str) -> bool:
        """Whether two present roles sit on disjoint ranks (so their calls can run at the same time)."""
        return (first in self.ranks and second in self.ranks
                and not set(self.ranks[first]) & set(self.ranks[second]))

    def describe(self) -> str:
        return ", ".join(f"{role} {_rank_span(ranks)}" for role, ranks in self.ranks.items())


def _rank_span(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


WHOLE_RANKS_TOLERANCE = 1e-6  # share * world this near a whole number is that many ranks (decimal shares round)


def ranks_text(count: int) -> str:
    """`count` ranks in words: "1 rank", "2 ranks"."""
    return f"{count} rank" if count == 1 else f"{count} ranks"


def share_text(count: int, world_size: int) -> str:
    """`count` of `world_size` ranks as the shortest decimal --placement_ratio reads back as that many ranks."""
    for digits in range(1, 18):
        text = f"{count / world_size:.{digits}g}"
        if abs(float(text) * world_size - count) <= WHOLE_RANKS_TOLERANCE / 10:
            return text
    return repr(count / world_size)


def shares_that_work(world_size: int) -> str:
    """The shares of `world_size` ranks a model may take: a whole number of ranks that divides the world."""
    shares = [share_text(count, world_size) for count in range(1, world_size + 1) if world_size % count == 0]
    return shares[0] if len(shares) == 1 else f"{', '.join(shares[:-1])} or {shares[-1]}"


def _whole_ranks(role: str, share: float, world_size: int) -> int:
    count = share * world_size
    if share <= 0 or count < 1 - WHOLE_RANKS_TOLERANCE:
        raise UserError(f"the placement gives the {role} a share of {share:g} of {ranks_text(world_size)}, which "
                        f"leaves it without a rank; give it at least {share_text(1, world_size)} (shares that work on "
                        f"{ranks_text(world_size)}: {shares_that_work(world_size)})")
    if abs(count - round(count)) > WHOLE_RANKS_TOLERANCE:
        raise UserError(f"the placement gives the {role} {share!r} of {world_size} ranks = {count!r} ranks; a share "
                        f"must come to a whole number of ranks: on {world_size} ranks give "
                        f"{shares_that_work(world_size)}")
    return round(count)


def _refuse_shares_of_absent_models(name: str, ratio: Mapping[str, float], present: list[str]) -> None:
    """A share that would move a model the run does not hold lays out nothing; the preset's own share (a list's
    critic position under a critic-free algorithm) changes nothing and passes."""
    preset = PRESETS[name]
    moved = [role for role in MODEL_ROLES if role not in present and ratio.get(role, preset[role]) != preset[role]]
    if moved:
        raise UserError(f"--placement_ratio gives the {' and the '.join(moved)} a share, but this run holds no "
                        f"{' and no '.join(moved)} (its models: {', '.join(present)}; an algorithm without a critic "
                        "trains none, and --reward_fn alone loads no reward model); "
                        f"{_absent_share_advice(name, ratio, present, moved)}")


def _absent_share_advice(name: str, ratio: Mapping[str, float], present: list[str], moved: list[str]) -> str:
    """What to give instead, in the form the user wrote: a list keeps its positions (the absent model's at the
    preset's share), named shares leave the absent models out."""
    held = {role: share for role, share in ratio.items() if role in present or role not in MODEL_ROLES}
    named = ",".join(f"{role}={share:g}" for role, share in held.items())
    by_model = f"--placement_ratio '{named}'" if named else "give no --placement_ratio"
    if isinstance(ratio, ShareList):
        listed = ",".join(f"{share if role in held else PRESETS[name][role]:g}" for role, share in ratio.items())
        positions = " and the ".join(f"{role}'s" for role in moved) + (" positions" if len(moved) > 1 else " position")
        return (f"a list cannot leave a position out: give the {positions} {name}'s share, --placement_ratio "
                f"'[{listed}]', or name the shares by model, {by_model}")
    return f"leave out the share of the {' and the '.join(moved)}: {by_model}"


def build_placement(name: str, world_size: int, roles: Iterable[str] = MODEL_ROLES,
                    ratio: Mapping[str, float] | None = None) -> Placement:
    """Lay out the present `roles` (the actor and reference always; the critic and reward model when the run has
    them) on `world_size` ranks by the preset `name` with `ratio`'s shares on top; every mistake is one
    `UserError` naming the model and the numbers, before anything loads."""
    if name not in PRESETS:
        raise UserError(f"unknown placement {name!r}; choose one of {', '.join(PLACEMENTS)}")
    present = [role for role in MODEL_ROLES if role in set(roles)]
    _refuse_shares_of_absent_models(name, ratio or {}, present)
    shares = {**PRESETS[name], **(ratio or {})}
    for role, share in shares.items():
        if not 0.0 <= share <= 1.0:
            raise UserError(f"the share of the {role} must lie in [0, 1], got {share:g}")
    rollout = 0 if shares["rollout"] == 0 else _whole_ranks("rollout", shares["rollout"], world_size)
    available = world_size - rollout
    if available < 1:
        raise UserError(f"the rollout share {shares['rollout']:g} takes every rank ({ranks_text(world_size)}) and "
                        "leaves none for the actor and the models that score; lower it")
    counts = {role: _whole_ranks(role, shares[role], world_size) for role in present}
    for role, count in counts.items():
        if count > available:
            raise UserError(f"more shares than ranks: the {role} asks for {count} of {world_size} ranks, but the "
                            f"rollout takes {ranks_text(rollout)} and leaves {available}")
    ranks: dict[str, tuple[int, ...]] = {}
    for first, second in CONCURRENT_PAIRS:
        pair = [role for role in (first, second) if role in counts]
        side_by_side = len(pair) == 2 and all(counts[role] < available for role in pair)
        if side_by_side and counts[first] + counts[second] > available:
            raise UserError(f"more shares than ranks: the {first} ({counts[first]} ranks) and the {second} "
                            f"({counts[second]} ranks) run at the same time on disjoint ranks, but only {available} "
                            "are available; lower their shares or give one of them all ranks")
        start = 0
        for role in pair:
            ranks[role] = tuple(range(start, start + counts[role]))
            start += counts[role] if side_by_side else 0
    if rollout:
        ranks["rollout"] = tuple(range(available, world_size))
    for role, members in ranks.items():
        if world_size % len(members):
            raise UserError(f"the {role} is on {len(members)} of {world_size} ranks; each of its ranks must serve the "
                            f"same number of ranks' batches, so {len(members)} must divide {world_size}: give it "
                            f"{shares_that_work(world_size)}")
    ordered = {role: ranks[role] for role in ROLES if role in ranks}
    return Placement(name if ratio is None else f"{name}+ratio", world_size, ordered)


# DeepSpeed's ZeRO-3 partitions a model over every rank, so each rank must hold it. The frozen models are built at
# their trained model's stage: the reference at the actor's, the reward model at the critic's; offloading a frozen
# model (`--offload_reference_model`/`--offload_reward_model`) makes it ZeRO-3 too.
ZERO3_BUILT_WITH = {"actor": ("actor", "reference"), "critic": ("critic", "reward")}
OFFLOAD = "offload"


def zero3_on_part_of_the_ranks(placement: Placement, actor_stage: int, critic_stage: int,
                               offloaded: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(what makes it ZeRO-3: the trained model whose stage is 3, or `OFFLOAD`; the model) for the first model
    ZeRO-3 would partition over only part of the ranks, or None. `offloaded`: the frozen models offloaded."""
    partitioned = [(owner, role) for owner, stage in (("actor", actor_stage), ("critic", critic_stage)) if stage == 3
                   for role in ZERO3_BUILT_WITH[owner]]
    partitioned += [(OFFLOAD, role) for role in offloaded]
    return next(((cause, role) for cause, role in partitioned
                 if placement.has(role) and len(placement.ranks[role]) < placement.world_size), None)
