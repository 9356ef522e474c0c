"""The HTTP / OpenAI edge: routes, request and response models, errors, auth. The only wing that imports
FastAPI."""
