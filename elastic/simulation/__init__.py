"""What a run at thousands of GPUs would see, simulated: failures drawn from published rates,
replayed against this product's recovery (with its real decision code) and against
restart-the-world and group-restart designs, on a simulated clock (``bench/at_scale.py``)."""
