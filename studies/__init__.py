"""The studies pipeline.py runs beside its five stages, one module each: on the embedded task
(embedded) and on a real instruct model (smollm2); the stage runner and table helpers they share
with pipeline.py (runner)."""
