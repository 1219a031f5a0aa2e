"""The (model, stage) pairs `ascendfactory init` writes starters for, per framework."""

from ascendfactory import catalog
from ascendfactory.frameworks import adapter


def starters(framework: str):
    fw = adapter(framework)
    for model_id, row in catalog.table(framework).rows.items():
        for stage in fw.stages:
            if fw.serves(row, stage):
                yield model_id, stage
