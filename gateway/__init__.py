"""The gateway: an OpenAI HTTP edge (api/) over the request path (requests/), the worker fleet (fleet/),
layout control (ratio/) and telemetry (telemetry/)."""
