"""What the engine and every backend share, below both of them.

Per DESIGN.md this layer sits under the engine and the backends (they import it; it imports
neither): structured-output specs and their grammars (:mod:`.structured_output`, :mod:`.grammar`),
tool-call formats and parsers (:mod:`.tool_calls`, :mod:`.tool_parsers`). The batched sampler and
the sampling parameters move here later.
"""
