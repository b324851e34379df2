"""A step's allocations as a function of the depth of a stack of identical layers.

A decoder repeats one layer N times (Llama 3 8B: 32 decoder layers). A step on fake tensors
costs time in proportion to the layers it runs, but what it allocates is periodic in them:
each layer's forward, backward and optimizer update allocate and free the same sizes in the
same order, except at the stack's ends (the first layer's input needs no gradient when
the embedding is frozen, so its backward is shorter). So the predictor (train/memory/predict.py)
computes the step of the same model cut to 2, 3 and 4 layers (`shallow_copy`) and builds
the events of all N from them (`DepthLine`):

- Structure (depths 2 and 3): the events of 3 layers are those of 2 with one more instance
  of each periodic region inserted (the fewest insertions that do it, a dynamic program;
  each is slid to the front of its run, where the depth-2 events hold the same tokens after
  it, so a region is a span of the depth-2 events and depth k holds k - 1 instances of it;
  two insertions meeting at one place are split). A token is an allocation's size, or a
  free with the size it frees and the phase (micro-batch, optimizer) of its allocation.
- References (depth 3): which allocation each free frees, as a rule in the instance
  numbers: the same instance (a layer's temporaries), one before (the previous layer's
  output), the mirror instance n-1-i (a layer's backward freeing what its forward saved),
  the first or last, or past the stack's ends (a learned position, or the region's
  continuation: the layer after the last is the head). Of the rules that explain every
  free, the one with the smallest shift is taken.
- Verified at depth 4, which the rules were not learned from: the events built for 4
  layers must equal the computed ones, free by free. Where they do not (two rules agree
  at depth 3 and the smallest shift chose wrongly: full fine-tuning's first layer), the
  rules are learned from depths 3 and 4 together and must give both. Only then is the
  line used, for any depth and for every micro-batch size whose depth-2 events free the
  same allocations as the learned ones (the sizes come from the depth-2 step of that
  size). FSDP's lines start from 3 layers (FSDP_DEPTHS): its end layers prefetch
  differently. tests/train/test_stack.py and `bench/prediction.py --fit-reports` check
  built steps against whole ones, event by event and to the byte.

A model without such a stack, or whose events are not periodic in it, is computed whole.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.train.language.quantize import fake_param, quant_state_tensors

Events = list[tuple[object, int]]  # (key, bytes) allocated, (key, -1) freed
DEPTHS = (2, 3, 4)  # the depths computed: 2 and 3 define the line, 4 verifies it
# FSDP prefetches the next layer's parameters in forward and backward: the two layers at
# the stack's ends differ from the others, so the line starts from 3 layers (1 in between).
FSDP_DEPTHS = (3, 4, 5)


def find_stack(model: nn.Module, min_depth: int = DEPTHS[-1] + 1) -> nn.ModuleList | None:
    """The longest ModuleList of at least `min_depth` layers of one class with the same
    parameters and buffers (names, shapes, dtypes), or None. A stack no deeper than the
    copies the line is learned from has nothing to gain: it is computed whole."""
    stacks = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) >= min_depth and _identical(m)
    ]
    return max(stacks, key=len, default=None)


def _identical(layers: nn.ModuleList) -> bool:
    first = _signature(layers[0])
    return all(_signature(layer) == first for layer in layers)


def _signature(module: nn.Module) -> tuple:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (
        type(module),
        tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in tensors),
    )


@contextmanager
def _cut(stack: nn.ModuleList, depth: int) -> Iterator[None]:
    layers = dict(stack._modules)
    stack._modules.clear()
    stack._modules.update(dict(list(layers.items())[:depth]))
    try:
        yield
    finally:
        stack._modules.clear()
        stack._modules.update(layers)


def shallow_copy(
    model: nn.Module, stack: nn.ModuleList, depth: int, mode: FakeTensorMode
) -> nn.Module:
    """A copy of `model`, whose tensors are fakes of `mode`, with the first `depth` layers
    of its stack; every tensor of the copy is a new fake of the same shape (nothing is
    allocated). Tensors are not deep-copied: torch 2.14 copies a fake's mode with it,
    which corrupts the heap."""
    with _cut(stack, depth):
        memo: dict[int, torch.Tensor] = {}
        with mode:
            for module in model.modules():
                tensors = [*module._parameters.values(), *module._buffers.values()]
                tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
                for tensor in tensors:
                    if tensor is not None and id(tensor) not in memo:
                        memo[id(tensor)] = _new_fake(tensor)
            for tensor in quant_state_tensors(model):  # 4-bit weights' scales
                if id(tensor) not in memo:
                    memo[id(tensor)] = _new_fake(tensor)
        copied = copy.deepcopy(model, memo)
    for module in copied.modules():  # a 4-bit weight reads its layer's (copied) state
        weight = module._parameters.get("weight")
        if getattr(weight, "quant_state", None) is not None:
            weight.quant_state, weight.module = module.quant_state, module
    return copied


def _new_fake(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    if isinstance(tensor, nn.Parameter):
        return fake_param(tensor, empty)
    return empty


# ------------------------------------------------------------------------------ the steps


@dataclass(frozen=True)
class Step:
    """A step's events and the marks in them (event counts: where each micro-batch after
    the first begins, and where the last one ends)."""

    events: Events
    marks: list[int]


@dataclass(frozen=True)
class _Canon:
    """A step as positions: every event and mark in order; each free as the position of
    the allocation it frees."""

    tokens: list[int]  # alignment tokens: 3 x bytes (alloc), 3 x freed bytes + 1, 3 x mark + 2
    sizes: list[int]  # bytes of an allocation, else -1
    targets: list[int]  # a free's allocation, else -1

    @classmethod
    def of(cls, step: Step) -> _Canon | None:
        tokens, sizes, targets = [], [], []
        where: dict[object, int] = {}
        marks = iter(enumerate(step.marks))
        mark = next(marks, None)
        for i, (key, nbytes) in enumerate([*step.events, (None, -1)]):
            while mark is not None and mark[1] == i:
                tokens.append(3 * mark[0] + 2)
                sizes.append(-1)
                targets.append(-1)
                mark = next(marks, None)
            if key is None:
                break
            if nbytes >= 0:
                where[key] = len(tokens)
                tokens.append(3 * nbytes)
                sizes.append(nbytes)
                targets.append(-1)
            else:
                if key not in where:  # freed what the step never allocated
                    return None
                target = where.pop(key)
                tokens.append(3 * sizes[target] + 1)
                sizes.append(-1)
                targets.append(target)
        _order_frees(tokens, targets)
        return cls(tokens, sizes, targets)

    def pattern(self) -> tuple[list[int], list[bool]]:
        """What a step of another micro-batch size must share with this one: which
        allocation each free frees, where the marks are."""
        return self.targets, [t % 3 == 2 for t in self.tokens]


def _order_frees(tokens: list[int], targets: list[int]) -> None:
    """Frees in a row, in the order of their allocations. Their order changes nothing that
    is predicted (the live bytes between them are not a peak; free blocks merge with
    their neighbours whatever the order), and some is not deterministic: CPU autocast's
    cast cache is a hash map of tensor addresses, emptied when the region exits."""
    p, n = 0, len(tokens)
    while p < n:
        end = p
        while end < n and targets[end] >= 0:
            end += 1
        if end - p > 1:
            run = sorted(zip(targets[p:end], tokens[p:end], strict=True))
            targets[p:end] = [t for t, _ in run]
            tokens[p:end] = [k for _, k in run]
        p = end + 1


# Origins of a position in the events of depth k: ("c", q) the depth-1 position q outside
# every region; ("r", j, i, o) offset o of instance i of region j.
_Origin = tuple


@dataclass(frozen=True)
class _Rule:
    """Where a free's allocation is, given the free's instance i among k: offset `offset`
    of instance t of a region (start, length: in the depths[0] positions), t by `family`.
    A t past the instances is read in `outside` (by its distance: -1 is just before the
    first, 0 just after the last), learned where the stack's ends differ (what the first
    layer frees of the embedding's output), else as the region's continuation, one
    instance length at a time (the layer after the last is the head)."""

    family: str  # "const": the position `start`; "same": t = i + shift; "mirror":
    # t = k-1-i + shift; "first": t = shift; "last": t = k-1-shift
    shift: int
    region: int
    start: int
    length: int
    offset: int
    outside: tuple[tuple[int, int], ...] = ()  # (distance, depths[0] position)

    def instance(self, i: int | None, k: int) -> int:
        return {
            "same": (i or 0) + self.shift,
            "mirror": k - 1 - (i or 0) + self.shift,
            "first": self.shift,
            "last": k - 1 - self.shift,
        }[self.family]

    def target(self, i: int | None, k: int) -> _Origin:
        if self.family == "const":
            return ("c", self.start)
        t = self.instance(i, k)
        if 0 <= t < k:
            return ("r", self.region, t, self.offset)
        return ("c", dict(self.outside).get(_distance(t, k), self.continued(t, k)))

    def continued(self, t: int, k: int) -> int:
        chunk = t - k + 1 if t >= k else t  # past the end: 1, 2, ...; before: -1, -2, ...
        return self.start + chunk * self.length + self.offset


def _distance(t: int, k: int) -> int:
    """How far instance t lies outside 0..k-1: -1, -2, ... before; 0, 1, ... after."""
    return t if t < 0 else t - k


_REGION_FAMILIES = ("same", "mirror")
_CONST_FAMILIES = ("first", "last")


class DepthLine:
    """The events of a step as a function of the stack's depth (module docstring)."""

    def __init__(
        self,
        depths: tuple[int, int, int],
        base: _Canon,
        regions: list[tuple[int, int]],
        rules: dict[tuple, _Rule],
    ):
        self.depths = depths  # those it was learned from, e.g. DEPTHS
        self.base = base  # the step at depths[0]
        self.regions = regions  # (start, length) in the depth-1 positions, in order
        self.rules = rules  # (template of a free) -> _Rule

    # --- learning ------------------------------------------------------------------------

    @classmethod
    def learn(cls, steps: dict[int, Step]) -> DepthLine | None:
        """From the steps at three consecutive depths (DEPTHS, FSDP_DEPTHS); None when
        they are not periodic in the depth."""
        depths = tuple(sorted(steps))
        assert len(depths) == 3 and depths[2] - depths[0] == 2, depths
        one, two, three = (_Canon.of(steps[d]) for d in depths)
        if one is None or two is None or three is None:
            return None
        regions = _regions(_by_phase(one), _by_phase(two))
        if regions is None:
            return None
        line = cls(depths, one, regions, {})
        origins = line._origins(2)
        if not line._same_shape(origins, two):
            return None
        rules = _learn_rules({2: (origins, two)}, regions)
        if rules is None:
            return None
        line.rules = rules
        built = line._build(3, one)
        if built is not None and _Canon.of(built) == three:
            return line
        # A rule the smallest shift chose wrongly (the first layer's backward frees the
        # second layer's output: "first + 1" and "last" agree at depth 3): learned again
        # from depths 3 and 4 together, one rule per free must give both.
        if not line._same_shape(line._origins(3), three):
            return None
        rules = _learn_rules({2: (origins, two), 3: (line._origins(3), three)}, regions)
        if rules is None:
            return None
        line.rules = rules
        built = line._build(3, one)
        return line if built is not None and _Canon.of(built) == three else None

    def instances(self, depth: int) -> int:
        """How many instances of each region the step at `depth` holds."""
        return depth - self.depths[0] + 1

    # --- building ------------------------------------------------------------------------

    def at(self, depth: int, one: Step) -> Step | None:
        """The step at `depth` for the micro-batch sizes of `one`, the step at depths[0];
        None when it does not free the same allocations as the one the line was learned
        from."""
        first = _Canon.of(one)
        if first is None or first.pattern() != self.base.pattern():
            return None
        return self._build(self.instances(depth), first)

    def _origins(self, k: int) -> list[_Origin]:
        return _origins(self.regions, len(self.base.tokens), k)

    def _source(self, origin: _Origin) -> int:
        """The depth-1 position whose token `origin` repeats."""
        return origin[1] if origin[0] == "c" else self.regions[origin[1]][0] + origin[3]

    def _same_shape(self, origins: list[_Origin], step: _Canon) -> bool:
        """Whether `step` has, position by position, the kinds and allocation sizes of
        the depth-1 tokens `origins` repeat (frees are checked by their rules)."""
        if len(origins) != len(step.tokens):
            return False
        tokens = self.base.tokens
        for origin, token in zip(origins, step.tokens, strict=True):
            expected = tokens[self._source(origin)]
            if token % 3 != expected % 3 or (token % 3 != 1 and token != expected):
                return False
        return True

    def _build(self, k: int, one: _Canon) -> Step | None:
        """The events with k instances of each region, sizes from `one`, each free freeing
        what its rule says."""
        origins = self._origins(k)
        position = {origin: p for p, origin in enumerate(origins)}
        events: Events = []
        marks: list[int] = []
        for p, origin in enumerate(origins):
            q = self._source(origin)
            token = one.tokens[q]
            if token % 3 == 2:
                marks.append(len(events))
            elif token % 3 == 0:
                events.append((p, one.sizes[q]))
            else:
                rule = self.rules[_template(origin)]
                target = position.get(rule.target(_instance(origin), k))
                if target is None:
                    return None
                events.append((target, -1))
        return Step(events, marks)


def _by_phase(step: _Canon) -> list[int]:
    """The step's tokens with each free named by the size it frees and the phase of its
    allocation (which micro-batch, or the optimizer's part after the last: the marks
    before it). Frees of one size are many and alike; so named, the insertions among them
    are found where they are (by bare sizes, the fewest insertions may merge two: one
    among a step's gradients, one among its optimizer's temporaries, freed in a row)."""
    marks = [p for p, t in enumerate(step.tokens) if t % 3 == 2]
    tokens = list(step.tokens)
    for p, target in enumerate(step.targets):
        if target >= 0:
            size, phase = step.tokens[p] // 3, bisect.bisect_left(marks, target)
            tokens[p] = 3 * (size * (len(marks) + 1) + phase) + 1
    return tokens


def _origins(regions: list[tuple[int, int]], n: int, k: int) -> list[_Origin]:
    """The origin of each position of a sequence of n positions, regions (start, length)
    in it, with k instances of each region."""
    origins: list[_Origin] = []
    q = 0
    for j, (start, length) in enumerate([*regions, (n, 0)]):
        origins += [("c", p) for p in range(q, start)]
        origins += [("r", j, i, o) for i in range(k) for o in range(length)]
        q = start + length
    return origins


def _regions(one: list[int], two: list[int]) -> list[tuple[int, int]] | None:
    """The regions (start, length) of `one` whose second instance turns it into `two`;
    None when `two` is not `one` with runs inserted, each a copy of what follows it."""
    regions = []
    for start, run in _insertions(one, two) or [(-1, [])]:
        if start < 0:
            return None
        found = _copied(one, start, run)
        if found is None:
            return None
        regions += found
    regions.sort()
    if any(s1 + l1 > s2 for (s1, l1), (s2, _) in zip(regions, regions[1:], strict=False)):
        return None
    return regions


def _copied(one: list[int], start: int, run: list[int]) -> list[tuple[int, int]] | None:
    """The region(s) whose second instance `run` inserted at `start` is: one, after
    sliding the run to the front of its copies (inserting run[-1:] + run[:-1] one earlier
    is the same insertion while the token before is run's last); or two meeting there, a
    copy of what precedes `start` and one of what follows (say the gradients' frees and
    the optimizer temporaries' frees of one more layer, both inserted where they meet)."""
    slid, at = run, start
    while at > 0 and one[at - 1] == slid[-1]:
        slid, at = slid[-1:] + slid[:-1], at - 1
    if one[at : at + len(slid)] == slid:
        return [(at, len(slid))]
    for m in range(1, len(run)):
        before, after = run[:m], run[m:]
        if one[start - m : start] == before and one[start : start + len(after)] == after:
            return [(start - m, m), (start, len(after))]
    return None


def _insertions(one: list[int], two: list[int]) -> list[tuple[int, list[int]]] | None:
    """`two` as `one` with the fewest runs inserted: (position in `one`, run) in order,
    or None when `one` is not a subsequence of `two`. A dynamic program over (i, d): the
    fewest runs that embed one[:i] in two[:i + d] with one[i - 1] matched last, vectorised
    over d (0 <= d <= len(two) - len(one))."""
    a, b = np.asarray(one, dtype=np.int64), np.asarray(two, dtype=np.int64)
    n, width = len(a), len(b) - len(a) + 1
    if width < 1:
        return None
    big = np.int64(1 << 40)
    index = np.arange(width)
    runs = np.where(index == 0, 0, 1).astype(np.int64)  # a leading run of d tokens
    came = np.empty((n, width), dtype=np.int32)  # the d a match came from
    for i in range(n):
        best = np.minimum.accumulate(runs)  # best[d]: fewest over d' <= d
        where = np.maximum.accumulate(np.where(runs == best, index, 0))
        opened = np.concatenate(([big], best[:-1] + 1))  # a new run ends at d - 1
        from_d = np.concatenate(([0], where[:-1]))
        stay = runs <= opened
        came[i] = np.where(stay, index, from_d)
        runs = np.where(b[i : i + width] == a[i], np.minimum(runs, opened), big)
    last = width - 1
    trailing = int(np.argmin(runs[:last])) if last else -1
    if runs[last] >= big and (trailing < 0 or runs[trailing] >= big):
        return None
    d = last if last == 0 or runs[last] <= runs[trailing] + 1 else trailing
    found = [] if d == last else [(n, list(two[n + d :]))]
    for i in range(n - 1, -1, -1):
        before = int(came[i][d]) if i else 0
        if before != d:
            found.append((i, list(two[i + before : i + d])))
        d = before
    return found[::-1]


def _template(origin: _Origin) -> tuple:
    return origin if origin[0] == "c" else ("r", origin[1], origin[3])


def _instance(origin: _Origin) -> int | None:
    return origin[2] if origin[0] == "r" else None


def _learn_rules(
    steps: dict[int, tuple[list[_Origin], _Canon]], regions: list[tuple[int, int]]
) -> dict[tuple, _Rule] | None:
    """A rule per free template explaining every free of `steps` (k instances: their
    origins and the step), or None."""
    seen: dict[tuple, list[tuple[int | None, int, _Origin]]] = {}
    for k, (origins, step) in steps.items():
        for p, target in enumerate(step.targets):
            if target >= 0:
                origin = origins[p]
                observed = (_instance(origin), k, origins[target])
                seen.setdefault(_template(origin), []).append(observed)
    rules = {}
    for template, observed in seen.items():
        rule = _rule(template, observed, regions)
        if rule is None:
            return None
        rules[template] = rule
    return rules


def _placed(target: _Origin, regions: list[tuple[int, int]], k: int) -> list[tuple[int, int, int]]:
    """(region, instance, offset) readings of a target: its own in a region; outside, as
    a continuation of each region (an instance before the first or after the last)."""
    if target[0] == "r":
        return [(target[1], target[2], target[3])]
    q, placed = target[1], []
    for j, (start, length) in enumerate(regions):
        if q >= start + length:
            chunk, offset = divmod(q - start - length, length)
            placed.append((j, k + chunk, offset))
        elif q < start:
            placed.append((j, -1 - (start - 1 - q) // length, (q - start) % length))
    return placed


def _rule(
    template: tuple,
    observed: list[tuple[int | None, int, _Origin]],
    regions: list[tuple[int, int]],
) -> _Rule | None:
    """The rule with the smallest shift that gives every observed (instance i of k,
    target)."""
    first = observed[0][2]
    if first[0] == "c" and all(target == first for _, _, target in observed):
        return _Rule("const", 0, -1, first[1], 0, 0)
    families = _REGION_FAMILIES if template[0] == "r" else _CONST_FAMILIES
    candidates = {}
    for i, k, target in observed:
        for region, t, offset in _placed(target, regions, k):
            start, length = regions[region]
            for family in families:
                shift = {
                    "same": t - (i or 0),
                    "mirror": t - (k - 1 - (i or 0)),
                    "first": t,
                    "last": k - 1 - t,
                }[family]
                rule = _Rule(family, shift, region, start, length, offset)
                fitted = _fitted(rule, observed)
                if fitted is not None:
                    candidates[fitted] = None
    return min(candidates, key=lambda r: (abs(r.shift), len(r.outside)), default=None)


def _fitted(rule: _Rule, observed: list[tuple[int | None, int, _Origin]]) -> _Rule | None:
    """`rule` with the positions outside its instances it needs to give every observed
    target, or None when it cannot."""
    outside: dict[int, int] = {}
    for i, k, target in observed:
        t = rule.instance(i, k)
        if 0 <= t < k:
            if target != ("r", rule.region, t, rule.offset):
                return None
        elif target[0] != "c" or (
            target[1] != rule.continued(t, k)
            and outside.setdefault(_distance(t, k), target[1]) != target[1]
        ):
            return None
    return dataclasses.replace(rule, outside=tuple(sorted(outside.items())))
