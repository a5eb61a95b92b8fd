"""One script per figure (fig*.py), each reading result files only; ``python -m paper_figures``
draws them all."""
