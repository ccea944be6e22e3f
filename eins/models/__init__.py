"""The workloads: the paper's LLaMA block (llama.py) and matrix chains A-E (chains.py)."""
from eins.models import chains, llama


def paper_workloads():
    """Every paper workload at paper size, shape-only: ``[(name, fn, ShapeDtype args)]`` for
    the LLaMA block's token workloads (paper config) and chains A-E."""
    work = [(f"llama {n}", w.function(llama.PAPER), w.args(llama.PAPER))
            for n, w in llama.WORKLOADS.items()]
    work += [(f"chain {c}", chains.chain(c).fn, chains.chain(c).shape_args())
             for c in chains.CHAINS]
    return work
