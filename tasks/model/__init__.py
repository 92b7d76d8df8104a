"""Model code: the project's GPT (gpt) and every model a stage trains, scores or serves behind
the one interface the stages use (causal_lm)."""
