"""A server for the HTTP hardening tests, in a process of its own so that its file-descriptor limit can
be lowered without touching the test runner: the in-kernel OpenAI app with a key, over a registry of
one model that is never generated from. Prints the port, serves until stdin closes.

    python http_worker.py --key KEY [--nofile N]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys


class OneModel:
    def list_models(self) -> list[str]:
        return ["m"]

    def resolve(self, name: str):
        raise KeyError(name)


async def _serve(key: str) -> None:
    from art_nb.local.server import InferenceGate, create_app, start_server

    server = await start_server(create_app(OneModel(), InferenceGate(), api_key=key))
    print(server.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    await server.stop(timeout=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--key", required=True)
    parser.add_argument("--nofile", type=int, default=0)
    args = parser.parse_args()
    if args.nofile:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))
    asyncio.run(_serve(args.key))


if __name__ == "__main__":
    main()
