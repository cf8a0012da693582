#!/usr/bin/python3
"""Scores translations with chrF (character n-gram F-score, Popovic 2015), computed by NLTK
(Debian: python3-nltk): n-grams of 1 to 6 characters, beta 3, whitespace ignored, the
corpus score the mean of the lines' scores (nltk.translate.chrf_score.corpus_chrf).

Input: JSON lines with "translation" and "reference", as
  isthmus-worker generate --translate LANG --input heldout-LANG.jsonl --output FILE
writes them. Prints "chrF <score> over <n> lines" (score x 100), or JSON with --json.

  deploy/chrf.py FILE [FILE...] [--json]
"""
import argparse
import json
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="JSON lines with translation and reference")
    parser.add_argument("--json", action="store_true", help="print one JSON object per file")
    args = parser.parse_args()
    try:
        from nltk.translate.chrf_score import corpus_chrf
    except ImportError:
        sys.exit("chrf.py: NLTK is missing: apt-get install python3-nltk")
    status = 0
    for path in args.files:
        references, hypotheses = [], []
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if not isinstance(row.get("translation"), str) or not isinstance(
                            row.get("reference"), str):
                        raise ValueError(f"line {number} has no \"translation\" and "
                                         "\"reference\" strings")
                    references.append(row["reference"])
                    hypotheses.append(row["translation"])
        except (OSError, ValueError) as e:
            print(f"chrf.py: {path}: {e}", file=sys.stderr)
            status = 1
            continue
        if not references:
            print(f"chrf.py: {path}: no lines to score", file=sys.stderr)
            status = 1
            continue
        score = 100.0 * corpus_chrf(references, hypotheses)
        if args.json:
            print(json.dumps({"file": path, "chrf": round(score, 4), "lines": len(references)}))
        else:
            print(f"{path}: chrF {score:.2f} over {len(references)} lines")
    return status


if __name__ == "__main__":
    sys.exit(main())
