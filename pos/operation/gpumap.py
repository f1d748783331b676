"""Which GPUs of this host a process or an image goes onto: the GPU pairs the driver's restore
takes (every GPU of the host once), from NVML's numbering (as nvidia-smi shows it). One rule
for both engines and both ways of moving (`pos migrate --to-gpu`, `pos restore --to-gpu`).

`--to-gpu N` moves a process on one GPU onto GPU N; `--to-gpu 0=1,1=0` names where each GPU of
a process on several goes (old index = new index)."""

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from pos import nvml
from pos.errors import BadInput

FORMS = "give a GPU index (--to-gpu 1) or a map of every GPU the job uses (--to-gpu 0=1,1=0)"


@dataclass(frozen=True)
class Onto:
    """Where `--to-gpu` sends a job: `index` (the one GPU it uses goes there) or `pairs` (NVML
    index -> NVML index, every GPU it uses named)."""

    index: Optional[int] = None
    pairs: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Onto":
        try:
            if "=" not in text:
                index = int(text)
                if index < 0:
                    raise ValueError
                return cls(index=index)
            pairs = tuple((int(a), int(b)) for a, b in
                          (item.split("=") for item in text.split(",")))
        except ValueError:
            raise BadInput(f"--to-gpu {text!r} is neither a GPU index nor a map", FORMS) from None
        olds, news = [a for a, _ in pairs], [b for _, b in pairs]
        if min(olds + news) < 0 or len(set(olds)) < len(olds) or len(set(news)) < len(news):
            raise BadInput(f"--to-gpu {text!r} names a GPU twice or a negative index",
                           "name each old and each new GPU once: --to-gpu 0=1,1=0")
        return cls(pairs=pairs)

    def check(self, here: list[nvml.Gpu]) -> None:
        """Refuse a target GPU this host does not have."""
        for new in [self.index] if self.index is not None else [b for _, b in self.pairs]:
            if new >= len(here):
                raise BadInput(f"this host has {len(here)} GPU(s), no GPU {new}",
                               f"give indices from 0 to {len(here) - 1}")

    def __str__(self) -> str:
        if self.index is not None:
            return str(self.index)
        return ",".join(f"{a}={b}" for a, b in self.pairs)


def gpu_pairs(used: list[str], onto: Onto, here: list[nvml.Gpu],
              index_of: dict[str, int]) -> list[tuple[str, str]]:
    """The driver's mapping: each GPU in `used` (UUIDs; `index_of` gives the NVML index each had
    where the job ran) onto its target among `here`, every other GPU of this host onto a GPU
    left over (itself where it can), so that the mapping covers every device once. A GPU not on
    this host (an image taken elsewhere) maps only as its target says."""
    if onto.index is not None:
        if len(used) != 1:
            seen = ", ".join(used) or "none seen by NVML"
            raise BadInput(f"the job uses {len(used)} GPUs ({seen})", "--to-gpu N moves jobs "
                           "on one GPU; map every GPU for one on several: --to-gpu 0=1,1=0")
        if used[0] not in index_of:
            index_of = {**index_of, used[0]: -1}
        wanted = {index_of[used[0]]: onto.index}
    else:
        wanted = dict(onto.pairs)
    onto.check(here)
    target: dict[str, str] = {}
    for u in used:
        old = index_of.get(u)
        if old not in wanted:
            raise BadInput(f"the job uses GPU {u} (index {old if old is not None else 'unknown'}"
                           f"), which --to-gpu {onto} does not name", FORMS)
        target[u] = here[wanted[old]].uuid
    if all(target[u] == u for u in used):
        raise BadInput(f"the job already runs where --to-gpu {onto} puts it "
                       f"({', '.join(used)})", "name other GPUs")
    taken = set(target.values())
    left = [g.uuid for g in here if g.uuid not in taken]
    rest = [g.uuid for g in here if g.uuid not in target]
    pairs = list(target.items())
    for u in rest:                       # the other GPUs of this host: themselves first
        if u in left:
            left.remove(u)
            pairs.append((u, u))
    paired = {u for u, _ in pairs}
    for u in rest:                       # then the GPUs left over, in order
        if u not in paired and left:
            pairs.append((u, left.pop(0)))
    return pairs


def check_host(onto: Onto) -> list[nvml.Gpu]:
    """This host's GPUs, once it is known to have NVML and the GPUs `onto` names: a move is
    refused for these before anything of the job or its image is read."""
    if not nvml.available():
        raise BadInput("NVML is not available (it names the GPUs for the driver's restore)",
                       "install the NVIDIA driver with libnvidia-ml.so.1")
    here = nvml.gpus()
    onto.check(here)
    return here


def move(onto: Onto, used: Callable[[], list[str]],
         index_of: Callable[[], dict[str, int]] = dict) -> list[tuple[str, str]]:
    """The driver's mapping that moves a job (a live process or an image) on the GPUs `used()`
    as `onto` says; `index_of()`: the NVML index each of them had where the job ran (for a
    live process, this host's). The host's GPUs are checked first, before anything is read."""
    here = check_host(onto)
    return gpu_pairs(used(), onto, here, {**{g.uuid: g.index for g in here}, **index_of()})


def of_process(pids: list[int], onto: Onto) -> list[tuple[str, str]]:
    """The driver's mapping that moves the processes `pids` of this host as `onto` says."""
    return move(onto, lambda: list(nvml.gpus_of(pids)))


def onto(gpus: Sequence[dict[str, Any]], where: Onto) -> tuple[list[tuple[str, str]], list[str]]:
    """The driver's mapping that restores an image taken on `gpus` (its manifest's) as `where`
    says, and the UUIDs of this host's GPUs that the image's GPUs go to, in the image's
    order."""
    pairs = move(where, lambda: [g["uuid"] for g in gpus],
                 lambda: {g["uuid"]: g["index"] for g in gpus if "index" in g})
    to = dict(pairs)
    return pairs, [to[g["uuid"]] for g in gpus]
