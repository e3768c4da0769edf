"""The wheel carries the built-in configs, scenarios and the source fingerprints (fingerprints.tsv) as the
package data `tpsim/builtin`, mapped from the repository's `configs/` (their one source); the rest of the metadata is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["tpsim", "tpsim.*"]), "tpsim.builtin"],
    package_dir={"tpsim.builtin": "configs"},
    package_data={"tpsim.builtin": ["*.yaml", "*.tsv", "scenarios/*.yaml", "scenarios/*.json", "scenarios/*/config.json",
                                    "scenarios/*/*.yaml",
                                    "scenarios/*/*.safetensors", "drafts/*.json",
                                    "drafts/*/config.json", "drafts/*/*.safetensors", "prompts/*.json"],
                  "tpsim.cli": ["commands.toml"]},
)
