#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <omp.h>
#include <sys/mman.h>
static void*amem(size_t n,int huge){void*p=NULL;posix_memalign(&p,1<<21,(n+(1<<21)-1)&~((size_t)(1<<21)-1));if(huge)madvise(p,n,MADV_HUGEPAGE);return p;}
int dw_qgemm(const int8_t *xq, const float *xs, const float *xsum, int rows, int n, int k, int g, int s,
             int bits, const uint8_t *q, const int8_t *sc, const int8_t *mn, const float *d, const float *dmin,
             float *y);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int n=atoi(argv[1]), k=atoi(argv[2]), bits=atoi(argv[3]), rows=atoi(argv[4]), copies=atoi(argv[5]), reps=atoi(argv[6]);
  int huge=atoi(argv[7]); int g=bits==6?16:32, s=bits==6?16:8;
  size_t qb=(size_t)n*k*bits/8, mb=(size_t)n*(k/g), db=(size_t)n*(k/g/s);
  uint8_t **q=malloc(sizeof(void*)*copies); int8_t **sc=malloc(sizeof(void*)*copies);float **d=malloc(sizeof(void*)*copies);
  for(int c=0;c<copies;c++){q[c]=amem(qb,huge);sc[c]=amem(mb,huge);d[c]=amem(db*4,huge);
    for(size_t i=0;i<qb;i++)q[c][i]=rand();for(size_t i=0;i<mb;i++)sc[c][i]=rand()%64;for(size_t i=0;i<db;i++)d[c][i]=0.01f;}
  int8_t*xq=malloc(rows*k);float*xs=malloc(4*rows*k/g),*xsum=malloc(4*rows*k/g),*y=malloc(4*(size_t)rows*n);
  for(int i=0;i<rows*k;i++)xq[i]=rand()%255-127;for(int i=0;i<rows*k/g;i++){xs[i]=0.01f;xsum[i]=0.1f;}
  double best=1e9;
  for(int r=0;r<reps;r++){double t=now();for(int c=0;c<copies;c++)dw_qgemm(xq,xs,xsum,rows,n,k,g,s,bits,q[c],sc[c],sc[c],d[c],d[c],y);t=now()-t;if(t<best)best=t;}
  double bytes=(double)copies*(qb+mb+2*db*4);
  printf("huge %d n %d k %d bits %d rows %d copies %d threads %d: %.3f ms per call, %.1f GB/s\n",huge,n,k,bits,rows,copies,omp_get_max_threads(),best/copies*1e3,bytes/best/1e9);
}
