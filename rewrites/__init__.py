"""One module per model family. Each exports `REWRITES`: the `surgery.Rewrite`s that `surgery.unfuse` applies."""
