/* The compiled XDP program (xsk_redirect.bpf.c) as bytes in .rodata,
   between sriovd_xsk_redirect_obj and sriovd_xsk_redirect_obj_end. */
        .section .rodata
        .balign 8
        .global sriovd_xsk_redirect_obj
        .global sriovd_xsk_redirect_obj_end
sriovd_xsk_redirect_obj:
        .incbin XSK_BPF_OBJ
sriovd_xsk_redirect_obj_end:
        .section .note.GNU-stack,"",@progbits
