"""What a plan costs: the paper's byte proxy (:mod:`eins.cost.proxy`, Section 4.3), the time
model of kernels (:mod:`eins.cost.predict`: a roofline per function specification, peak
memory) and the optimizer's time cost of a plan (:mod:`eins.cost.timecost`: kernels plus
exchanges, as the simulator would time them). Passes and runtimes read them; they read
neither."""
