"""scripts/sass_loops.py: a `cuobjdump -sass` listing's loops (backward branches' ranges),
each with its instructions, its HMMA and its spill instructions, innermost first."""

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;              /* 0x00000a0000017a02 */
        /*0010*/                   STL [R1+0x4], R2 ;                  /* 0x0000000000000000 */
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ; /* 0x0000000000000000 */
        /*0030*/                   LDL.LU.64 R6, [R1+0x8] ;            /* 0x0000000000000000 */
        /*0040*/               @P0 BRA 0x20 ;                          /* 0x0000000000000000 */
        /*0050*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ; /* 0x0000000000000000 */
        /*0060*/              @!P1 BRA 0x10 ;                          /* 0x0000000000000000 */
        /*0070*/                   BRA 0x90 ;                          /* 0x0000000000000000 */
        /*0080*/                   EXIT ;                              /* 0x0000000000000000 */
"""


def test_loops_innermost_first_with_their_hmma_and_spills(load_script):
    sass = load_script("sass_loops")
    instrs = sass.parse(LISTING)
    assert [a for a, _ in instrs] == list(range(0, 0x90, 0x10)) and instrs[1][1] == "STL [R1+0x4], R2"
    rows = sass.loops(instrs)  # the forward BRA at 0x70 is no loop
    assert [(r["start"], r["end"], r["instructions"], r["hmma"], r["spills"]) for r in rows] == [
        (0x20, 0x40, 3, 1, 1), (0x10, 0x60, 6, 2, 2)]
