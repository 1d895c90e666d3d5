"""The second half of the notebooks' install cell: what this runtime's GPU needs, at tested versions.

The cell installs art_nb itself first (from the package index, or from `ART_NB_SOURCE`), then runs
`python -m art_nb.notebook.install STATE_JSON`. In a process of its own on purpose: importing art_nb
in the kernel would load pydantic and openai there, and vLLM's set upgrades both, which would force
a restart that nothing else needed.

What it installs comes from what art_nb ships, so the versions are written once:
- the requirements of the extras for the runtime's stack, read from art_nb's own metadata
  (`notebook` + `gpu` on a GPU, `notebook` + `cpu` without one; on Turing the gpu extra's vLLM is
  held to 0.11.2 by the constraint file, the last release with an attention backend there);
- `pip install -c` with the stack's constraint file (`art_nb/constraints/{stack}.txt`, the files
  `art_nb.local.plan.versions` reads), the stack picked from `nvidia-smi`'s compute capability by
  `versions.stack_for`.
Colab's own numpy, ipywidgets and pillow (and its torch on a CPU runtime; vLLM needs its own) are kept
when pip can keep them; when it cannot, the second try lets pip change them and says so. At the end
it says whether the runtime must restart, and why: a package this kernel had already imported
changed on disk (the kernel would keep running the old one).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..local.plan.hardware import Hardware, from_nvidia_smi
from ..local.plan.versions import constraints_file, pins, stack_for

__all__ = ["KEEP", "Plan", "install", "main", "plan_for", "requirements", "restart_reasons"]

DISTRIBUTION = "art-nb"
KEEP = ("numpy", "ipywidgets", "pillow")
"""The runtime's own copies, kept where pip can: Colab's widgets and image stack are built around them."""

_EXTRAS = {"cpu": ("notebook", "cpu"), "turing": ("notebook", "gpu"), "ampere": ("notebook", "gpu")}
_EXTRA_MARKER = re.compile(r"""^\s*extra\s*==\s*["']([^"']+)["']\s*$""")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[\s\[<>=!~;@(]", requirement.strip(), maxsplit=1)[0])


def requirements(extras: Sequence[str], declared: Sequence[str] | None = None) -> list[str]:
    """The requirements of art_nb's `extras` (and its base), from its installed metadata; a
    requirement on another extra of art_nb itself ("art-nb[cpu]") is expanded in place."""
    declared = list(metadata.requires(DISTRIBUTION) or []) if declared is None else list(declared)
    wanted, seen = list(extras), set()
    result = [r for r in declared if ";" not in r]  # the base requirements
    while wanted:
        extra = wanted.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for line in declared:
            requirement, _, marker = line.partition(";")
            found = _EXTRA_MARKER.match(marker)
            if found is None or found.group(1) != extra:
                continue
            name = _requirement_name(requirement)
            if name == DISTRIBUTION:  # "art-nb[cpu]; extra == 'gpu'"
                inner = re.search(r"\[([^\]]+)\]", requirement)
                wanted += [e.strip() for e in inner.group(1).split(",")] if inner else []
            elif requirement.strip() not in result:
                result.append(requirement.strip())
    return result


@dataclass(frozen=True)
class Plan:
    """One runtime's install: the stack, why, what to install, and the pins to try first and then."""

    stack: str
    why: str
    requirements: list[str]
    kept: dict[str, str]  # the runtime's own versions, pinned on the first try
    stack_pins: dict[str, str]  # the stack's file, less what is kept

    def constraints(self, keep: bool) -> str:
        pinned = {**self.stack_pins, **(self.kept if keep else {})}
        return "".join(f"{name}=={version}\n" for name, version in pinned.items())


def plan_for(hardware: Hardware, installed: Mapping[str, str], declared: Sequence[str] | None = None) -> Plan:
    """What to install on `hardware`, given the `installed` distributions ({normalized name: version})."""
    stack = stack_for(hardware.gpu_capability)
    if hardware.gpu_capability is None:
        why = "no GPU: the CPU set (transformers engine, peft trainer)"
    elif stack == "turing":
        why = (f"{hardware.gpu_name} ({hardware.sm}): the T4 set, vLLM 0.11.2 (the last release for this GPU) + "
               "Unsloth; the transformers engine serves if vLLM cannot start here")
    else:
        why = f"{hardware.gpu_name} ({hardware.sm}): the vLLM + Unsloth set run on an H200"
    keep = (*KEEP, "torch") if stack == "cpu" else KEEP  # on a GPU vLLM pins its own torch
    kept = {name: installed[name] for name in keep if name in installed}
    stack_pins = {name: version for name, version in pins(stack).items() if name not in kept}
    return Plan(stack, why, requirements(_EXTRAS[stack], declared),
                kept, stack_pins)


def installed_versions() -> dict[str, str]:
    """{normalized distribution name: version} of everything installed."""
    return {_normalize(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def restart_reasons(before: Mapping[str, str], after: Mapping[str, str], imported: set[str]) -> list[str]:
    """"torch 2.6.0 -> 2.11.0" for each distribution that changed and provides a module in `imported`."""
    providers: dict[str, set[str]] = {}
    for module, names in metadata.packages_distributions().items():
        for name in names:
            providers.setdefault(_normalize(name), set()).add(module)
    reasons = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None or old == new:
            continue  # new packages cannot be loaded already
        if providers.get(name, {name.replace("-", "_")}) & imported:
            reasons.append(f"{name} {old} -> {new or 'removed'}")
    return reasons


def _pip(requirements: Sequence[str], constraints: str, quiet_failure: bool) -> bool:
    """One `pip install -c` run; with `quiet_failure` its error output is held back (a retry follows)."""
    handle, path = tempfile.mkstemp(prefix="art_nb-constraints-", suffix=".txt")
    with os.fdopen(handle, "w") as file:
        file.write(constraints)
    command = [sys.executable, "-m", "pip", "install", "-q", *requirements, "-c", path]
    done = subprocess.run(command, capture_output=quiet_failure, text=True)
    os.unlink(path)
    return done.returncode == 0


def install(state: Mapping[str, object]) -> int:
    """Install the runtime's stack; print what happened and whether to restart. Returns an exit code.

    `state` is what the install cell saved before installing art_nb: `versions` (distribution ->
    version) and `modules` (top-level modules the kernel had imported).
    """
    before = {_normalize(k): str(v) for k, v in dict(state.get("versions") or {}).items()}  # type: ignore[call-overload]
    imported = set(state.get("modules") or ())  # type: ignore[call-overload]
    hardware = from_nvidia_smi(Hardware())
    plan = plan_for(hardware, installed_versions())
    print(f"installing art_nb's {plan.stack} set ({plan.why}): {len(plan.requirements)} requirements, "
          f"pinned by {constraints_file(plan.stack).name}" + (" (a few minutes)" if plan.stack != "cpu" else ""))
    if not _pip(plan.requirements, plan.constraints(keep=True), quiet_failure=bool(plan.kept)):
        if not plan.kept:
            print(f"pip could not install the {plan.stack} set: its error is above.")
            return 1
        kept = ", ".join(f"{name} {version}" for name, version in plan.kept.items())
        print(f"note: the {plan.stack} set needs other versions of some of {kept}; letting pip change them")
        if not _pip(plan.requirements, plan.constraints(keep=False), quiet_failure=False):
            print(f"pip could not install the {plan.stack} set: its error is above.")
            return 1
    reasons = restart_reasons(before, installed_versions(), imported)
    if reasons:
        print(f"RESTART NEEDED: {', '.join(reasons)} changed after this kernel imported "
              f"{'it' if len(reasons) == 1 else 'them'}: Runtime > Restart session, then Run all "
              "(the install is skipped the second time).")
    else:
        print(f"art_nb installed with the {plan.stack} set; no restart needed.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m art_nb.notebook.install STATE_JSON` (what the install cell runs)."""
    args = list(sys.argv[1:] if argv is None else argv)
    state = json.loads(Path(args[0]).read_text()) if args else {}
    return install(state)


if __name__ == "__main__":
    raise SystemExit(main())
