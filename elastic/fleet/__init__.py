"""The Ray edge: every call from the driver to rank processes. `api` is the interface and its
errors (no Ray, what the control loop and the tests' fake fleet share); `ray_fleet` makes
the calls; `rank_processes` places, starts and kills rank actors and warm spares;
`rendezvous` is the driver's TCPStore the ranks build their process groups on; `ray_messages`
keeps Ray's explanations of the deaths the run handles off the console.
"""
