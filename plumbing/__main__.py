"""`python -m plumbing export OUT_DIR [DEST]`: the Hugging Face export of OUT_DIR's resumable
checkpoint (checkpoints.export), into DEST or OUT_DIR/export-step-N."""
import argparse
import sys

from transformers.utils import logging as hf_logging

from plumbing import checkpoints

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m plumbing", description="What a run's folder needs besides the scripts: "
                                     "`export` writes its resumable checkpoint as a Hugging Face folder.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="export")
    export = commands.add_parser("export", help="the Hugging Face export of a run's resumable checkpoint",
                                 description="Write the resumable checkpoint of OUT_DIR (--save_every's, or a run "
                                             "stopped midway) as a Hugging Face folder, in the run's --save_dtype, "
                                             "loadable by AutoModelForCausalLM and by every script's --model. A "
                                             "finished run needs none: its OUT_DIR/checkpoint is one already.")
    export.add_argument("out_dir", metavar="OUT_DIR", help="the run's folder, or its checkpoint/ folder")
    export.add_argument("dest", metavar="DEST", nargs="?", default=None,
                        help="a new or empty folder to write into (default: OUT_DIR/export-step-N)")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    try:
        print(f"exported {checkpoints.export(args.out_dir, args.dest)}")
    except (OSError, ValueError) as e:  # a destination refused, a checkpoint missing, damaged or final: named
        sys.exit(f"python -m plumbing export: {e}")
