"""The in-kernel OpenAI-compatible endpoint over any `Engine`, one job per module:

- `schema`: the request body, validated, with a 400 naming what to send instead;
- `pipeline`: render prompt -> sampling params -> generate -> cut at stop -> tool calls -> choice;
- `turns`: earlier turns this endpoint sampled go back to the model as their sampled ids;
- `prompt`: the chat template's rendering, special-token text in client strings kept as text;
- `templates`: a served model's chat template, tool style and turn setting, set at register;
- `toolcalls`: Hermes/Qwen `<tool_call>` blocks into OpenAI `tool_calls`;
- `responses`, `responses_out`: POST /v1/responses, served as a chat completion, answered as a Response;
- `completions`: POST /v1/completions, legacy text completions of a raw prompt;
- `gate`: `InferenceGate`, the backend's pause/resume around a train step;
- `app`: `create_app`, the routes over a backend's `ModelRegistry`;
- `run`: `start_server`, uvicorn as a task on the backend's event loop.

Errors, auth and the loopback rule are shared with `art-nb serve` through `art_nb.web`.
"""

from .app import ModelRegistry, ServedModel, create_app
from .gate import InferenceGate
from .run import RunningServer, start_server
from .schema import ChatCompletionRequest

__all__ = [
    "ChatCompletionRequest",
    "InferenceGate",
    "ModelRegistry",
    "RunningServer",
    "ServedModel",
    "create_app",
    "start_server",
]
