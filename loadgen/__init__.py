"""`pdserve bench`: an open-loop load generator for any OpenAI-compatible server, with stage breakdown."""
