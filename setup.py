"""Package list for setuptools (metadata lives in pyproject.toml).

capability_matrix/ and templates/ sit at the repository root (DESIGN.md) but install as
ascendfactory.capability_matrix / ascendfactory.templates; find_packages cannot see them under
those names, so they are added here next to the discovered code packages.
"""

from setuptools import find_packages, setup

DATA_PACKAGES = ["ascendfactory.capability_matrix", "ascendfactory.templates"]

setup(packages=find_packages(include=["ascendfactory", "ascendfactory.*", "backends", "backends.*"]) + DATA_PACKAGES)
