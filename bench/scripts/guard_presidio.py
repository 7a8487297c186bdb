#!/usr/bin/env python3
"""Presidio's analyzer over the guard's labelled data set: the peer column of `keel bench guard`.

Runs presidio-analyzer's predefined pattern recognizers (email, phone, credit card, IBAN, US SSN,
IP address) with a blank spaCy pipeline as its NLP engine (no model download), every text
analyzed as English (its pattern recognizers are registered for "en"), default score
threshold. Presidio has no recognizers for credentials in URLs or for API keys and tokens, so
those entities are not reported for it.

Prints one JSON object: {"findings": {id: [[entity, start, end], ...]}, "seconds": analysis
time over all texts, "bytes": UTF-8 bytes analyzed, "version": presidio-analyzer's version}.
Offsets are character offsets, as in the data set.

Run in a venv that has presidio-analyzer (not needed by CI):
  python3 -m venv /work/venvs/presidio && /work/venvs/presidio/bin/pip install presidio-analyzer
  /work/venvs/presidio/bin/python bench/scripts/guard_presidio.py bench/data/guard/texts.jsonl
"""
import json
import logging
import sys
import time
from importlib.metadata import version

import spacy
from presidio_analyzer import AnalyzerEngine
from presidio_analyzer.nlp_engine import SpacyNlpEngine

ENTITIES = {
    "EMAIL_ADDRESS": "email",
    "PHONE_NUMBER": "phone",
    "CREDIT_CARD": "card",
    "IBAN_CODE": "iban",
    "US_SSN": "ssn",
    "IP_ADDRESS": "ip",
}


class BlankSpacy(SpacyNlpEngine):
    """spaCy's tokenizer only: no tagger, lemmatizer or NER model to download."""

    def load(self):
        self.nlp = {"en": spacy.blank("en")}


def main():
    # tldextract (under the URL recognizer) tries to fetch the public suffix list and logs
    # each failure offline before it falls back to its bundled copy.
    logging.getLogger("tldextract").setLevel(logging.CRITICAL)
    path = sys.argv[1] if len(sys.argv) > 1 else "bench/data/guard/texts.jsonl"
    items = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    engine = BlankSpacy(models=[{"lang_code": "en", "model_name": "blank"}])
    engine.load()
    analyzer = AnalyzerEngine(nlp_engine=engine, supported_languages=["en"])
    wanted = list(ENTITIES)
    analyzer.analyze(text="warm up jane@example.com", language="en", entities=wanted)
    findings = {}
    total = 0
    t0 = time.perf_counter()
    for it in items:
        res = analyzer.analyze(text=it["text"], language="en", entities=wanted)
        findings[str(it["id"])] = [[ENTITIES[r.entity_type], r.start, r.end] for r in res]
        total += len(it["text"].encode("utf-8"))
    seconds = time.perf_counter() - t0
    json.dump({"findings": findings, "seconds": seconds, "bytes": total,
               "version": version("presidio-analyzer")}, sys.stdout)


if __name__ == "__main__":
    main()
