"""argparse for nanoserve's command lines: every option's help shows its default, and a usage mistake is one
line (the usage of `nanoserve serve` alone is dozens)."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless it says it already or there is none."""

    def _get_help_string(self, action):
        if "(default" in (action.help or "") or action.default in (None, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """A usage mistake is one line and exit code 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
