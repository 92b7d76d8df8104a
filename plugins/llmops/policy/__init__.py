"""What a run may ask for and may use: the Param table (params), teams (teams), what a run costs
and the refusal when it is too much (budget), a sweep's study (sweep_study), model references
(model_refs), the promotion gate (promotion) and its paired statistics (paired)."""
