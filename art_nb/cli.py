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
        if field.default is None:  # learning_rate: None picks it by the model's size
            parser.add_argument(flag, type=float, default=None, help="default: by the base model's size")
        elif field.name == "pipeline":  # `--pipeline` alone turns it on
            parser.add_argument(flag, nargs="?", const="on", default=field.default, choices=("auto", "on", "off"),
                                help="play step N+1's games while step N trains (art.pipeline); default: auto, the "
                                "plan's choice (off on a CPU)")
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default,
                                help=f"default: {field.default}")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="run the backend behind an HTTP API for RemoteBackend clients")
    parser.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (only this machine can connect)")
    parser.add_argument("--port", type=int, default=8000, help="default: 8000 (0 picks a free port)")
    parser.add_argument("--path", default=".art", help="where checkpoints and logs go; default: .art")
    parser.add_argument("--token-file", default=None, metavar="PATH",
                        help="read the bearer token from PATH (default: $ART_NB_SERVE_TOKEN, else generated, printed "
                        "once and saved for RemoteBackend on this machine under ~/.config/art-nb, mode 600); "
                        "16 characters at least off loopback")
    parser.add_argument("--no-token", action="store_true",
                        help="no auth: every account on this machine can then download, delete and train "
                        "(loopback only)")
    # Refused, with the way to pass a token: a command line is readable by every local user.
    parser.add_argument("--token", nargs="?", const="", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--allowed-origin", dest="allowed_origins", action="append", default=[], metavar="ORIGIN",
                        help="a browser origin allowed to call the server cross-site, e.g. http://localhost:8888 "
                        "for a JupyterLab on another port (repeatable; default: none)")
    parser.add_argument("--allow-local-models", action="store_true",
                        help="let clients name directories on this machine as base_model (default: hub ids only)")


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
        from .remote.serve import TOKEN_ENV, serve

        if args.token is not None:  # never echoed: it is already on display in the process list
            parser.error(f"--token is refused: every user of this machine can read a command line (ps, "
                         f"/proc/<pid>/cmdline), and so the token. Put it in a file only you can read and pass "
                         f"--token-file PATH, or set the {TOKEN_ENV} environment variable; with neither, a token "
                         "is generated and printed once")
        try:
            serve(args.host, args.port, args.path, token_file=args.token_file, no_token=args.no_token,
                  allowed_origins=args.allowed_origins, allow_local_models=args.allow_local_models)
        except ValueError as exc:  # a token that cannot be read, too short, or --no-token off loopback
            parser.error(str(exc))
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
