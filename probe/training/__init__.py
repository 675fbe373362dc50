"""Training: the papers' objectives (LongCE, CDT, LOGO) and the attention-only networks of the controlled
position-bias study."""
