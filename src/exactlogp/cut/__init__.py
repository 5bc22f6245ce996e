"""The exact min-p / top-k / top-p cut (docs/numerics.md section 13), in the order of its
stages: options.py (the checked options on the call), integers.py (exact limbs, keys and
threshold selects), candidates.py (the columns a block can keep), blocks.py (one block's
exact steps), driver.py (the cut of a call across the ranks), processed.py (the log-softmax
over the kept set), draw.py (sample's inverse CDF), api.py (the public functions)."""
