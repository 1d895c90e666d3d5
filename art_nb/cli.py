"""`art-nb`: the command line. Thin: each subcommand calls the public API."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

__all__ = ["main"]


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    from .demo import DemoConfig

    parser = sub.add_parser("demo", help="train SmolLM2-135M on tic-tac-toe with GRPO (CPU is fine)")
    for field in dataclasses.fields(DemoConfig):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=field.default, help=f"default: {field.default}")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="run the backend behind an HTTP API for RemoteBackend clients")
    parser.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (other hosts require a token)")
    parser.add_argument("--port", type=int, default=8000, help="default: 8000 (0 picks a free port)")
    parser.add_argument("--path", default=".art", help="where checkpoints and logs go; default: .art")
    parser.add_argument("--token", default=None, help="bearer token; default: $ART_NB_SERVE_TOKEN, else "
                        "generated and printed once when the host is not loopback")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="art-nb", description="GRPO + LoRA for multi-step LLM agents")
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import DemoConfig, run_demo

        config = DemoConfig(**{k: v for k, v in vars(args).items() if k != "command"})
        asyncio.run(run_demo(config))
        return 0
    if args.command == "serve":
        from .backends.serve import serve

        serve(args.host, args.port, args.path, args.token)
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
