"""Whole files: long-form windowing shared by HTTP and offline, the offline API, the CLI, WER scoring."""
