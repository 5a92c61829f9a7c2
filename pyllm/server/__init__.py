"""`pyllm serve`: an OpenAI-compatible HTTP server over one LLM (app.py: routes; scheduler.py: the model worker)."""
