"""A model's run directory to and from S3 (ART's `_experimental_push_to_s3` / `_pull_from_s3`).

The layout is ART's, so a bucket ART wrote can be pulled here and the other way round:
s3://{bucket}/{prefix/}{project}/models/{name}/ holds what `{path}/{project}/models/{name}/` holds
(checkpoints/{step:04d}/, history.jsonl, trajectories/). Copying is a sync: a file whose size
already matches is not sent again. Hidden files (the writer lock, temporaries of a checkpoint being
written) never leave the machine.

A pulled checkpoint appears whole or not at all: it is downloaded into a temporary sibling the
store removes after a crash (`.tmp-...`) and renamed into place, so `register` never resumes from
half a checkpoint. Over fsspec/s3fs (`pip install art-nb[s3]`); the endpoint, region and
credentials are boto's usual ones (AWS_* environment variables, ~/.aws), e.g. AWS_ENDPOINT_URL for
an S3-compatible server.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Literal

from art_nb.store import (
    RECORD_PARTS,
    checkpoint_key,
    checkpoint_path,
    checkpoint_step_of,
    checkpoints_dir,
    model_subpath,
    staging_path,
)

__all__ = ["model_url", "pull", "push"]


def _filesystem() -> Any:
    try:
        import s3fs
    except ImportError:
        raise ImportError("S3 needs s3fs, which is not installed: pip install 'art-nb[s3]' "
                          "(or pip install s3fs)") from None
    # A fresh instance each time (no fsspec instance or listing cache): the endpoint and credentials
    # are read from the environment now, and a listing reflects the bucket now.
    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


def model_url(project: str, name: str, bucket: str | None, prefix: str | None) -> str:
    """`bucket/{prefix/}{project}/models/{name}` (no scheme: s3fs paths start with the bucket)."""
    bucket = bucket or os.environ.get("BACKUP_BUCKET")
    if not bucket:
        raise ValueError("no S3 bucket: pass s3_bucket='my-bucket' or set the BACKUP_BUCKET environment variable")
    prefix_part = f"{prefix.strip('/')}/" if prefix else ""
    return f"{bucket}/{prefix_part}{model_subpath(project, name)}"


def _visible(relative: str) -> bool:
    return not any(part.startswith(".") for part in relative.split("/"))


def _local_files(root: Path) -> dict[str, Path]:
    if not root.is_dir():
        return {}
    files = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file()}
    return {rel: p for rel, p in files.items() if _visible(rel)}


def _remote_files(fs: Any, url: str) -> dict[str, int]:
    """Relative path -> size of every object under `url`."""
    found = fs.find(url, detail=True) if fs.exists(url) else {}
    return {key[len(url) + 1:]: int(info.get("size") or 0) for key, info in found.items()
            if key.startswith(url + "/") and _visible(key[len(url) + 1:])}


def push(local_dir: Path, url: str, *, delete: bool = False, verbose: bool = False) -> list[str]:
    """Upload what `local_dir` holds to `url` (files already there with the same size are skipped);
    `delete` removes objects that are not local. The bucket is created if missing (as ART does).
    Returns the relative paths uploaded."""
    if not local_dir.is_dir():
        raise FileNotFoundError(f"nothing to push: {local_dir} does not exist (train or log the model first)")
    fs = _filesystem()
    bucket = url.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    local = _local_files(local_dir)
    remote = _remote_files(fs, url)
    sent = sorted(rel for rel, path in local.items() if remote.get(rel) != path.stat().st_size)
    for rel in sent:
        fs.put_file(str(local[rel]), f"{url}/{rel}")
        if verbose:
            print(f"upload {local[rel]} -> s3://{url}/{rel}")
    if delete:
        for rel in sorted(set(remote) - set(local)):
            fs.rm_file(f"{url}/{rel}")
            if verbose:
                print(f"delete s3://{url}/{rel}")
    return sent


def pull(url: str, local_dir: Path, *, only_step: int | Literal["latest"] | None = None, delete: bool = False,
         exclude: list[str] | None = None, verbose: bool = False) -> list[str]:
    """Download `url` into `local_dir` (files already there with the same size are skipped).

    `only_step` (an int, or "latest") takes that one checkpoint and no other; `exclude` leaves out
    "checkpoints", "trajectories" or "logs" (history); `delete` removes local files the bucket does
    not have. Returns the relative paths downloaded.
    """
    unknown = set(exclude or []) - set(RECORD_PARTS)
    if unknown:
        raise ValueError(f"exclude={sorted(unknown)}: choose from {sorted(RECORD_PARTS)}")
    fs = _filesystem()
    remote = _remote_files(fs, url)
    skipped = tuple(p for name in exclude or [] for p in RECORD_PARTS[name])
    remote = {rel: size for rel, size in remote.items() if not rel.startswith(skipped)}
    in_checkpoint = {rel: checkpoint_step_of(rel) for rel in remote}
    steps = sorted({step for step in in_checkpoint.values() if step is not None})
    if only_step is not None:
        wanted = (steps[-1:] if only_step == "latest" else [int(only_step)])
        if only_step != "latest" and int(only_step) not in steps:
            raise FileNotFoundError(f"s3://{url} has no checkpoint {only_step}; it has {steps or 'none'}")
        remote = {rel: size for rel, size in remote.items() if in_checkpoint[rel] in (None, *wanted)}
        steps = wanted
    local_dir.mkdir(parents=True, exist_ok=True)
    local = _local_files(local_dir)
    fetched: list[str] = []
    for step in steps:  # a checkpoint: into a temporary sibling, then renamed into place whole
        prefix = f"{checkpoint_key(step)}/"
        files = {rel: size for rel, size in remote.items() if rel.startswith(prefix)}
        if all(rel in local and local[rel].stat().st_size == size for rel, size in files.items()):
            continue
        target = checkpoint_path(checkpoints_dir(local_dir), step)
        tmp = staging_path(target.parent, f"pull-{step:04d}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for rel in files:
            destination = tmp / rel[len(prefix):]
            destination.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{url}/{rel}", str(destination))
            fetched.append(rel)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        if verbose:
            print(f"checkpoint s3://{url}/{prefix} -> {target}")
    for rel, size in remote.items():  # records: each file replaced whole
        if in_checkpoint[rel] is not None or (rel in local and local[rel].stat().st_size == size):
            continue
        destination = local_dir / rel
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial = staging_path(destination.parent, f"pull-{destination.name}")
        fs.get_file(f"{url}/{rel}", str(partial))
        os.replace(partial, destination)
        fetched.append(rel)
        if verbose:
            print(f"download s3://{url}/{rel} -> {destination}")
    if delete:
        for rel, path in local.items():
            kept = rel.startswith(skipped) or (only_step is not None and checkpoint_step_of(rel) is not None)
            if rel not in remote and not kept:
                path.unlink()
    return fetched
