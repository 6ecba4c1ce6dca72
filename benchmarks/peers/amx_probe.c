#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
int main(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) { puts("no-perm"); return 2; }
  struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg;
  memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
  for (int i = 0; i < 3; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  _tile_loadconfig(&cfg);
  static uint16_t a[16*32], b[16*32]; static float c[16*16];
  for (int i = 0; i < 16*32; i++) { a[i] = 0x3f80; b[i] = 0x3f80; }
  _tile_zero(0); _tile_loadd(1, a, 64); _tile_loadd(2, b, 64);
  _tile_dpbf16ps(0, 1, 2); _tile_stored(0, c, 64); _tile_release();
  printf("%s %f\n", c[0] == 32.0f ? "amx-ok" : "amx-wrong", c[0]); return c[0] == 32.0f ? 0 : 1;
}
