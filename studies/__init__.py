"""The studies pipeline.py runs beside its five stages, one module each: on the embedded task
(embedded) and on a real instruct model (smollm2); the stage runner and table helpers they share
with pipeline.py (runner). And those run on their own (`python -m studies.NAME`): each off-policy
correction's exact bias and variance (offpolicy_exact), what moves the pipeline's numbers
(reproducibility), every script on every data format on SmolLM2 (smollm2_formats), SmolLM2 before
any tool loop (smollm2_tools)."""
