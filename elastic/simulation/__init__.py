"""What a run at thousands of GPUs would see, simulated: failures drawn from published rates,
replayed on a simulated clock against this product's recovery as it runs today (with its real
decision code) and against restart-the-world and group-restart designs, every phase's cost a
named figure, and the model first run with each publication's own parameters against its
published figure (``bench/at_scale.py``)."""
