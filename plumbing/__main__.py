"""`python -m plumbing export OUT_DIR [DEST]`: the Hugging Face export of OUT_DIR's resumable
checkpoint (checkpoints.export), into DEST or OUT_DIR/export-step-N."""
import sys

from transformers.utils import logging as hf_logging

from plumbing import checkpoints

if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "export":
        sys.exit("usage: python -m plumbing export OUT_DIR [DEST]: the Hugging Face export of OUT_DIR's resumable "
                 "checkpoint")
    hf_logging.disable_progress_bar()
    try:
        print(f"exported {checkpoints.export(*sys.argv[2:])}")
    except (OSError, ValueError) as e:  # a destination refused, a checkpoint missing or damaged: named
        sys.exit(f"python -m plumbing export: {e}")
