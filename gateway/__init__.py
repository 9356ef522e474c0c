"""The gateway: an OpenAI HTTP edge (api/) over the request path (requests/), the worker fleet (fleet/),
layout control (ratio/), the fleet's owner and the frontends' link to it (control/) and telemetry
(telemetry/). app.py, lifespans.py, config.py and serve_settings.py compose them."""
